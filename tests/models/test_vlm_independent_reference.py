"""Parity against a reference that does not share our prompt code.

test_vlm_parity.py builds transformers' prompt with our own adapter (`build_prompt` / `process`),
so a wrong prompt layout would sit on both sides and pass. Here, for every architecture, the prompt
string is written by hand the way a transformers user writes it (the model card / processor
convention, or the processor's own chat template where the tiny processor has one), handed to
`AutoProcessor` directly, and run through `AutoModelForImageTextToText.generate` greedily. Our engine
gets the same request as TGI chunks (text str / image bytes in prompt order). The prompt ids our
engine ran (reported back through prefill logprobs), the generated tokens and the per-step logits
must all equal transformers'.

Nothing from tgi_vlm.models.architectures (nor tests.models.vlm_reference, which uses it) is imported.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from functools import lru_cache

import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor
from transformers.modeling_outputs import MoeCausalLMOutputWithPast

from tests.models.reference import assert_matches, hf_greedy
from tgi_vlm.testing import VLM_ARCHS, make_test_image, png_bytes, tiny_model_path
from tgi_vlm.testing.harness import make_request

# transformers 5.24 bug: Llama4ForConditionalGeneration.forward reads `outputs.image_outputs` from
# the MoeCausalLMOutputWithPast its language model returns, which has no such field, so `generate`
# raises AttributeError. A class-level default makes transformers' own generate usable. (Our Llama4
# adapter applies the same workaround; it is repeated here so the reference imports no adapter.)
if not hasattr(MoeCausalLMOutputWithPast, "image_outputs"):
    MoeCausalLMOutputWithPast.image_outputs = None

IMG_A = png_bytes(make_test_image(37, 53, seed=11))
IMG_B = png_bytes(make_test_image(64, 30, seed=12))
MAX_NEW_TOKENS = 6


@dataclass(frozen=True)
class Case:
    chunks: tuple  # what our engine receives: text (str) and image (bytes) chunks in prompt order
    prompt: str | None  # the hand-written transformers prompt (None: rendered from `messages`)
    messages: list | None = None  # chat messages for the processor's own chat template
    add_special_tokens: bool = True


# Each prompt below is written independently of our adapters, from the architecture's documented
# convention; the processor then expands the placeholder into the image's token block.
CASES: dict[str, Case] = {
    # Qwen2-VL model card / chat template: the processor expands only <|image_pad|>; the
    # <|vision_start|> / <|vision_end|> wrapper is the prompt's job. The tokenizer adds no BOS.
    "qwen2_vl": Case(
        chunks=("<|im_start|>user\nLook at ", IMG_A, " and describe it<|im_end|>\n<|im_start|>assistant\n"),
        prompt="<|im_start|>user\nLook at <|vision_start|><|image_pad|><|vision_end|> and describe it"
        "<|im_end|>\n<|im_start|>assistant\n",
    ),
    # Qwen2.5-VL, same convention, two images (two grids in the mrope positions).
    "qwen2_5_vl": Case(
        chunks=("First ", IMG_A, " then second ", IMG_B, " compare them"),
        prompt="First <|vision_start|><|image_pad|><|vision_end|> then second "
        "<|vision_start|><|image_pad|><|vision_end|> compare them",
    ),
    # LLaVA-NeXT (Mistral) model card: "[INST] <image>\n... [/INST]"; the tokenizer adds <s>.
    "llava_next": Case(
        chunks=("[INST] Look at ", IMG_A, "\nand describe it [/INST]"),
        prompt="[INST] Look at <image>\nand describe it [/INST]",
    ),
    # Idefics2 model card: "User:<image>...<end_of_utterance>\nAssistant:"; the processor wraps
    # <image> in <fake_token_around_image>; the tokenizer adds BOS.
    "idefics2": Case(
        chunks=("User: Look at ", IMG_A, " and describe it<end_of_utterance>\nAssistant:"),
        prompt="User: Look at <image> and describe it<end_of_utterance>\nAssistant:",
    ),
    # Idefics3 model card: the same "<image>"; the processor expands it into the tile grid with
    # <row_i_col_j> and <global-img> markers.
    "idefics3": Case(
        chunks=("User: Look at ", IMG_B, " and describe it<end_of_utterance>\nAssistant:"),
        prompt="User: Look at <image> and describe it<end_of_utterance>\nAssistant:",
    ),
    # SmolVLM: same "<image>" convention as Idefics3.
    "smolvlm": Case(
        chunks=("Look at ", IMG_A, " and describe it"),
        prompt="Look at <image> and describe it",
    ),
    # PaliGemma model card: the processor is called with the task prefix only ("caption en") and
    # the image; it builds "<image>"*n + <bos> + prefix + "\n" itself. PaliGemma has no interleaved
    # text: the image comes first.
    "paligemma": Case(
        chunks=(IMG_A, "caption en"),
        prompt="caption en",
    ),
    # Gemma 3 model card / chat template: the image is "<start_of_image>" inside the user turn; the
    # processor expands it to "\n\n<start_of_image><image_soft_token>*n<end_of_image>\n\n". The
    # tokenizer adds <bos>.
    "gemma3": Case(
        chunks=("<start_of_turn>user\nLook at ", IMG_A, " and describe it<end_of_turn>\n<start_of_turn>model\n"),
        prompt="<start_of_turn>user\nLook at <start_of_image> and describe it<end_of_turn>\n<start_of_turn>model\n",
    ),
    # Llama 4: the tiny processor carries Llama 4's chat template, which writes <|image|> for an
    # image and starts with <|begin_of_text|>; so, as TGI's chat route does, no special tokens are
    # added on top.
    "llama4": Case(
        chunks=(
            "<|begin_of_text|><|header_start|>user<|header_end|>\n\nLook at ",
            IMG_B,
            " and describe it<|eot|><|header_start|>assistant<|header_end|>\n\n",
        ),
        prompt=None,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Look at "},
                    {"type": "image"},
                    {"type": "text", "text": " and describe it"},
                ],
            }
        ],
        add_special_tokens=False,
    ),
}


def test_every_architecture_has_a_hand_written_case():
    assert set(CASES) == set(VLM_ARCHS)


@pytest.fixture(scope="module", params=VLM_ARCHS)
def arch(request):
    return request.param


@lru_cache(maxsize=1)
def transformers_side(arch: str):
    path = tiny_model_path(arch)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(path)


def reference_inputs(arch: str) -> dict:
    case = CASES[arch]
    _, processor = transformers_side(arch)
    prompt = case.prompt
    if prompt is None:
        prompt = processor.apply_chat_template(case.messages, add_generation_prompt=True, tokenize=False)
        # The engine's chunks must be the rendered template, with each image where it wrote <|image|>.
        assert prompt == "<|image|>".join(c for c in case.chunks if isinstance(c, str))
    images = [Image.open(io.BytesIO(c)).convert("RGB") for c in case.chunks if isinstance(c, bytes)]
    inputs = dict(
        processor(text=prompt, images=images, add_special_tokens=case.add_special_tokens, return_tensors="pt")
    )
    inputs.pop("labels", None)  # PaliGemma returns them even without a suffix
    inputs["pixel_values"] = inputs["pixel_values"].float()
    return inputs


def test_engine_matches_transformers_on_a_hand_written_prompt(runner, arch):
    case = CASES[arch]
    inputs = reference_inputs(arch)
    request = make_request(
        0,
        *case.chunks,
        max_new_tokens=MAX_NEW_TOKENS,
        prefill_logprobs=True,
        add_special_tokens=case.add_special_tokens,
    )
    runner.prefill([request])
    runner.run()

    expected_ids = inputs["input_ids"][0].tolist()
    ran_ids = list(runner.generations[0][0].prefill_tokens.ids)
    assert len(ran_ids) == len(expected_ids), f"{arch}: {len(ran_ids)} prompt tokens, transformers {len(expected_ids)}"
    assert ran_ids == expected_ids, f"{arch}: prompt ids differ from the processor's on the hand-written prompt"

    model, _ = transformers_side(arch)
    assert_matches(runner, 0, hf_greedy(model, inputs, MAX_NEW_TOKENS))
