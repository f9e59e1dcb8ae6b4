"""vLLM's LoRA routes of the OpenAI HTTP API (``http.OpenAIServer`` takes
them): ``POST /v1/load_lora_adapter`` ``{lora_name, lora_path}`` and
``POST /v1/unload_lora_adapter`` ``{lora_name}``. The adapters themselves
live in the engine (``jaxserve.engine.adapters``); the ``model`` field of a
completion picks one (``Frontend.resolve_model``)."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import Response

from jaxserve.engine.adapters import UnknownAdapterError
from jaxserve.server import openai_protocol as oai


class LoRARoutes:
    """The LoRA routes; the server provides ``_auth``, ``_ready``, ``_body``,
    ``_errors`` and ``frontend``."""

    async def _lora_body(self, request: Request, fields: tuple[str, ...]) -> tuple[str, ...]:
        """The named string fields of a LoRA route's body; 400 when LoRA is
        off or a field is missing or not a non-empty string."""
        self._auth(request)
        engine = self._ready()
        body = await self._body(request)
        if engine.max_loras is None:
            raise oai.bad_request("LoRA is not enabled: start the server with --enable_lora "
                                  "(or --lora_modules)")
        if not isinstance(body, dict):
            raise oai.bad_request("the body must be a JSON object")
        out = []
        for f in fields:
            v = body.get(f)
            if not isinstance(v, str) or not v:
                raise oai.bad_request(f"{f}: must be a non-empty string", f)
            out.append(v)
        return tuple(out)

    async def load_lora_adapter(self, request: Request):
        """vLLM's ``POST /v1/load_lora_adapter`` ``{lora_name, lora_path}``:
        registers the PEFT folder (read and checked on a worker thread); 400
        for a bad folder (naming the file and field) or a name in use."""
        name, path = await self._lora_body(request, ("lora_name", "lora_path"))
        if name == self.frontend.model_name:
            raise oai.bad_request(f"lora_name: {name!r} is the served model's name",
                                  "lora_name")
        with self._errors():
            await self.frontend.engine.add_lora(name, path)
        return Response(f"Success: LoRA adapter '{name}' added successfully.",
                        media_type="text/plain")

    async def unload_lora_adapter(self, request: Request):
        """vLLM's ``POST /v1/unload_lora_adapter`` ``{lora_name}``; 404 for a
        name not loaded. Requests running with it finish with it."""
        (name,) = await self._lora_body(request, ("lora_name",))
        try:
            self.frontend.engine.remove_lora(name)
        except UnknownAdapterError as e:
            raise oai.APIError(404, str(e), "lora_name") from None
        return Response(f"Success: LoRA adapter '{name}' removed successfully.",
                        media_type="text/plain")


__all__ = ["LoRARoutes"]
