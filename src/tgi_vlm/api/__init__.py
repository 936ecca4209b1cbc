"""`tgi-vlm launch`: TGI's HTTP API served from the router driver (needs the `server` extra).

    launch.py      start the shard (as TGI's launcher does) and the router, then uvicorn; stop in reverse
    app.py         the FastAPI app: routes, TGI-shaped error answers, guards
    routes/        generate.py (/generate, /generate_stream, /) · openai.py (/v1/...) · service.py (/info,
                   /health, /metrics, /tokenize)
    state.py       what the routes share (router, token counter, validator, metrics, chat template)
    infer.py       concurrency permits, validation, one request through the router, cancellation, errors
    validation.py  TGI's parameter and length checks → the router's RequestParams
    images.py      markdown images: data URIs, URLs fetched with size and time limits
    chat.py        chat messages → prompt text through the model's chat template
    schemas.py     request bodies (pydantic) · responses.py: response bodies · sse.py: event stream
    errors.py      TGI's {"error", "error_type"} answers · guards.py: API key, payload limit
    disconnect.py  non-streaming requests cancelled when their client goes away
    metrics.py     Prometheus text under TGI's metric names

Nothing here imports the engine, the shard server or the benchmarks (`tgi-vlm bench --url` is
benchmarking/targets/http.py); tests/unit/test_layering.py checks what importing it loads.
"""
