"""``jaxrl serve``: an OpenAI-compatible HTTP server over the sampler (or a generate-compatible engine).

    app = serve.create_app(sampling.Sampler(model, tok, max_len=512), model_name="my-model")
    with serve.ServerThread(app, port=0) as srv:     # or: jaxrl serve --model DIR --port 8000
        openai.OpenAI(base_url=srv.url, api_key="none").chat.completions.create(...)

A reward model's directory (``reward_head.safetensors``) is served with :func:`create_reward_app`
(``POST /v1/rewards``). See ``docs/rewards.md`` (section "jaxrl serve").

Layer (docs/design.md): may import ``envs``, ``rl`` and the layers below; not ``cli``.
"""

from jaxrl.serve._app import ServerThread, create_app, render_chat
from jaxrl.serve._batcher import Backend, Batcher, GenRequest, RowResult, row_request_id
from jaxrl.serve._reward import create_reward_app

__all__ = ["Backend", "Batcher", "GenRequest", "RowResult", "ServerThread", "create_app", "create_reward_app",
           "render_chat", "row_request_id"]
