"""Chapter 9: ``minillm serve``: load the checkpoint, build the engine, print how to call it,
run uvicorn. Binds 127.0.0.1 unless told otherwise: the server has no rate limits and, without
``--api-key``, no authentication, so exposing it is a deliberate choice (``--host 0.0.0.0``).
``--max-body-bytes`` caps a request body (413 beyond it); ``--shutdown-timeout`` is how long the
first Ctrl-C (or SIGTERM) lets the requests in flight finish (`minillm.server.shutdown`)."""
from __future__ import annotations

from pathlib import Path

from minillm.engine.config import EngineConfig

__all__ = ["banner", "serve"]


def serve(model: str | Path, config: EngineConfig, *, host: str = "127.0.0.1", port: int = 8000,
          api_key: str | None = None, log_level: str = "info", max_body_bytes: int | None = None,
          shutdown_timeout: float | None = None) -> None:
    """Serve the checkpoint folder ``model`` until Ctrl-C (or SIGTERM): the first drains the
    requests in flight for ``shutdown_timeout`` seconds, a second stops at once."""
    import uvicorn

    from minillm.engine import LLMEngine
    from minillm.server.app import create_app
    from minillm.server.middleware import DEFAULT_MAX_BODY_BYTES
    from minillm.server.shutdown import DEFAULT_SHUTDOWN_TIMEOUT, GracefulServer

    engine = LLMEngine.from_pretrained(model, config)
    print(banner(engine, host, port, api_key is not None), flush=True)
    app = create_app(engine, api_key=api_key, max_body_bytes=max_body_bytes or DEFAULT_MAX_BODY_BYTES)
    server = GracefulServer(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                           timeout_graceful_shutdown=5),
                            app.state.runner, DEFAULT_SHUTDOWN_TIMEOUT if shutdown_timeout is None else shutdown_timeout)
    server.run()


def banner(engine, host: str, port: int, with_key: bool) -> str:
    """What the server is, where, and a ``curl`` and an ``openai`` example to call it."""
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
    name, c = engine.model_name, engine.config
    auth = ' -H "Authorization: Bearer $API_KEY"' if with_key else ""
    key = 'os.environ["API_KEY"]' if with_key else '"none"'
    imports = "import os\n" if with_key else ""
    chat = "" if engine.chat_template is None else f"""
for chunk in client.chat.completions.create(model="{name}", stream=True, max_tokens=48, stop=["\\n\\n"],
                                            messages=[{{"role": "user", "content": "Wherefore art thou?"}}]):
    print(chunk.choices[0].delta.content or "", end="", flush=True)
print()"""
    unit = "pages" if c.kv_cache == "virtual" else "blocks"  # Chapter 11: a page of every layer's K and V
    return f"""
minillm: serving {name!r} at {url}/v1  (Ctrl-C to stop)
  {engine.device.type}, max_model_len {engine.max_model_len}, KV pool {engine.manager.num_blocks} \
{unit} of {engine.manager.block_size} tokens, prefix caching {'on' if c.enable_prefix_caching else 'off'}

curl:
  curl {url}/v1/completions -H "Content-Type: application/json"{auth} \\
    -d '{{"model": "{name}", "prompt": "ROMEO:", "max_tokens": 32}}'

openai (Python):
{imports}from openai import OpenAI
client = OpenAI(base_url="{url}/v1", api_key={key})
print(client.completions.create(model="{name}", prompt="ROMEO:", max_tokens=32).choices[0].text){chat}
"""
