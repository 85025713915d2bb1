"""A second Serve app that calls the rayspec app through `serve.get_app_handle` (composition example).

    serve.run(HandleClient.options(ray_actor_options={"num_cpus": 0}).bind("rayspec"), name="client", route_prefix="/client")
    POST /client {"prompt": "...", "max_tokens": 16, "temperature": 0}
"""

from __future__ import annotations

from ray import serve
from starlette.requests import Request

from deployments.transport.protocol import GenerateRequest


@serve.deployment  # resources via .options(...) at bind time
class HandleClient:
    def __init__(self, app_name: str = "rayspec"):
        self.app_name = app_name

    async def complete(self, request: dict) -> dict:
        handle = serve.get_app_handle(self.app_name)
        resp = await handle.generate.remote(GenerateRequest.model_validate(request))
        return resp.model_dump()

    async def complete_streamed(self, request: dict) -> dict:
        handle = serve.get_app_handle(self.app_name)
        text, ids = "", []
        async for chunk in handle.options(stream=True).generate_stream.remote(GenerateRequest.model_validate(request)):
            text += chunk.delta_text
            ids += chunk.delta_token_ids
        return {"text": text, "token_ids": ids}

    async def __call__(self, request: Request) -> dict:
        return await self.complete(await request.json())
