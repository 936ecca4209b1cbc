"""Benchmarks of the serving stack (`tgi-vlm bench`), apart from the router that `launch` runs on.

    run.py          run_bench(options): the named workload on the named target, through its comparison
    options.py      BenchOptions / WorkloadOptions (what the command line asked for), BenchError
    workloads.py    the registry of named workloads: synthetic, multiturn, shared-prefix
    synthetic.py    deterministic synthetic requests and conversations (WorkloadSpec, ConversationSpec)
    load.py         how a workload's requests are sent: Requests (closed / open loop), Chats (turn by turn)
    targets/        what serves them: driver (the router driver against a shard), http (a running launch)
    references/     the same requests elsewhere: transformers' generate
    comparisons.py  what a run is compared with: "reference", "prefix-caching"
    results.py      RequestResult, ServingResult, ReferenceResult, percentiles
    report.py       the reference comparison's JSON, table, summary lines and chart
    prefix_report.py  the prefix comparison's JSON, markdown and summary lines
    profile.py      py-spy samples of the shard (--profile), summed into buckets
    progress.py     progress lines on stderr

Imports point one way: this package uses router/ (the driver, request types, the token counter) and, for
the transformers reference only, models/architectures (the prompt layout); router/ and api/ never import
it (tests/unit/test_layering.py).
"""
