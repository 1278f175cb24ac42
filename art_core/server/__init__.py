"""The OpenAI-compatible HTTP server: `/v1/chat/completions` (plain and streamed) and the rollout routes.

`app` (create_app, serve_in_thread, ServerHandle), `router` (ModelRouter, ServedModel, StaticRouter,
UnknownModelError), `openai_format`, `chat_completion`, `chat_stream`, `rollout_routes`, `errors` and
`middleware`. It reaches engines through `art_core.engine`'s protocol. Exports are eager.
"""

from art_core.server.app import ServerHandle, create_app, serve_in_thread
from art_core.server.router import ModelRouter, ServedModel, StaticRouter, UnknownModelError

__all__ = [
    "ModelRouter",
    "ServedModel",
    "ServerHandle",
    "StaticRouter",
    "UnknownModelError",
    "create_app",
    "serve_in_thread",
]
