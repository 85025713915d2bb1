"""Application builders: `import_path: deployments.app:build_app` with our `args: {...}` (AppArgs; vLLM's
names taken too), or `deployments.app:build_llm_app` with Ray Serve LLM's (`llm_configs: [LLMConfig]`,
what `ray.serve.llm:build_openai_app` takes; deployments/dialects.py).

colocated:      OpenAIIngress -> Verifier (engine + in-process proposer)
disaggregated:  OpenAIIngress -> Verifier (engine + RemoteProposer) -> Proposer
  paired:       OpenAIIngress -> Verifier (engine + RemoteProposer) -> its own proposer actor
                (no Proposer deployment; deployments/replicas/pairing.py)

With several verifier replicas the ingress's handle routes by prompt prefix (the Verifier's
request_router_config, AppArgs.prefix_routing: deployments/replicas/prefix_router.py).

Python handle API (from a driver connected to the cluster, or from another deployment):

    from ray import serve
    from deployments.transport.protocol import GenerateRequest
    h = serve.get_app_handle("rayspec")
    resp = h.generate.remote(GenerateRequest(prompt="Hello", max_tokens=32, temperature=0)).result()
    for chunk in h.options(stream=True).generate_stream.remote(GenerateRequest(prompt="Hi", max_tokens=8)):
        print(chunk.delta_text, end="")
"""

from __future__ import annotations

import dataclasses
import secrets

from pydantic import SecretStr
from ray.serve import Application

from deployments.config import AppArgs, load_app_args, resolve_api_key
from deployments.dialects import translate_llm_app_args
from deployments.frontend.ingress import OpenAIIngress
from deployments.replicas.proposer import Proposer
from deployments.replicas.verifier import Verifier


def pin_hub_revisions(cfg: AppArgs) -> AppArgs:
    """The target's and draft's hub ids with their revisions resolved to commits, once, where the
    app is built (rayspec.model.weights.hub.pin_revision): every replica then loads the same files, even when
    a branch moves while replicas start or scale. The served name stays the one asked for."""
    from rayspec.model.weights.hub import pin_revision

    update: dict = {}
    model = pin_revision(cfg.model)
    if model != cfg.model:
        update.update(model=model, served_model_name=cfg.model_name)
    draft = cfg.speculative.draft_model
    if draft:
        pinned = pin_revision(draft)
        if pinned != draft:
            update["speculative"] = dataclasses.replace(cfg.speculative, draft_model=pinned)
    return cfg.model_copy(update=update) if update else cfg


def build_app(args: dict | AppArgs | None = None) -> Application:
    cfg = pin_hub_revisions(load_app_args(args))
    plain = cfg.model_dump(mode="json", exclude={"api_key"})  # what travels to every replica
    proposer = channel_secret = None
    if cfg.topology == "disaggregated":
        # one per application build, for the verifier <-> proposer direct channel's handshake; only
        # those two deployments get it (SecretStr: a repr or log line shows stars)
        channel_secret = SecretStr(secrets.token_urlsafe(32))
        if not cfg.paired:  # paired: each verifier replica starts its own proposer
            proposer = Proposer.options(**cfg.proposer_options()).bind(plain, channel_secret)
    verifier = Verifier.options(**cfg.verifier_options()).bind(plain, proposer, channel_secret)
    api_key = resolve_api_key(cfg.api_key)  # the ingress alone checks it
    return OpenAIIngress.options(**cfg.ingress_options()).bind(plain, verifier, api_key)


def build_llm_app(args: dict | None = None) -> Application:
    """Ray Serve LLM's builder args (`llm_configs: [{model_loading_config, engine_kwargs,
    deployment_config, accelerator_type, ...}]`, one model) served by rayspec: the same app as
    build_app, so a Ray Serve LLM config changes only its import_path."""
    return build_app(translate_llm_app_args(args))
