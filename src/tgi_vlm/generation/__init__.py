"""Token selection and stopping: logits processors, grammar masks, seeded choosers, stopping
criteria, incremental detokenization and reported logprobs. Pure PyTorch (+ llguidance); no gRPC here."""

from tgi_vlm.generation.chooser import ChosenTokens, TokenChooser, choose_tokens
from tgi_vlm.generation.detokenizer import IncrementalDetokenizer, token_text, token_texts
from tgi_vlm.generation.grammar import GrammarMasker, GrammarState, GrammarType
from tgi_vlm.generation.grammar_compiler import CompiledGrammar, GrammarCompiler, GrammarError
from tgi_vlm.generation.logits_process import LogitBias, LogitsPipeline, Watermark
from tgi_vlm.generation.logprobs import prefill_logprobs, top_n
from tgi_vlm.generation.parameters import SamplingParameters, validate_parameters
from tgi_vlm.generation.speculative import Drafter, NgramDrafter, accepts
from tgi_vlm.generation.stopping import FinishReason, StoppingCriteria

__all__ = [
    "ChosenTokens",
    "Drafter",
    "NgramDrafter",
    "accepts",
    "CompiledGrammar",
    "FinishReason",
    "GrammarCompiler",
    "GrammarError",
    "GrammarMasker",
    "GrammarState",
    "GrammarType",
    "IncrementalDetokenizer",
    "LogitBias",
    "LogitsPipeline",
    "SamplingParameters",
    "StoppingCriteria",
    "TokenChooser",
    "Watermark",
    "choose_tokens",
    "prefill_logprobs",
    "token_text",
    "token_texts",
    "top_n",
    "validate_parameters",
]
