"""Routing a request to a model: the one place where catalog and residency errors become HTTP answers.

The catalog resolves names (aliases, class default, household default); the residency manager
leases a node serving the model. Both raise domain errors; this module maps them to ApiErrors.
"""

from __future__ import annotations

import math
from pathlib import Path

from app.policy import ClassPolicy
from app.protocols.errors import public_text
from app.protocols.openai import ApiError
from app.residency.manager import (
    Lease,
    ModelBusy,
    ModelLoadFailed,
    ModelState,
    NotEnoughMemory,
    ResidencyManager,
    UnknownModel,
)
from app.residency.supervisor import RUNNER_LOG_MARK
from app.services.catalog import Catalog, DefaultModelPending, ModelEmbedded, ModelNotFound, ModelUnusable


def pending_error(progress: dict) -> ApiError:
    """The 503 for a request that needs the default model while it is assembled (or failed to be)."""
    if progress["error"]:
        return ApiError(503, f"the default model could not be assembled: {public_text(progress['error'])}",
                        code="default_model_failed", err_type="unavailable_error", headers={"Retry-After": "60"})
    being = "assembled" if progress["phase"] == "assembling" else "verified"
    return ApiError(503, f"the default model is being {being} ({progress['percent']} %); retry in a few seconds",
                    code="default_model_assembling", err_type="unavailable_error", headers={"Retry-After": "5"})


class Router:
    """Model names to leases on runners, with the household's HTTP errors for what cannot be served."""

    def __init__(self, catalog: Catalog, residency: ResidencyManager):
        self.catalog = catalog
        self.residency = residency

    def resolve(self, requested: str | None, policy: ClassPolicy | None) -> str:
        """The catalog name for a request's model; 404 if unknown or unusable, 503 while the default is assembled."""
        try:
            return self.catalog.resolve(requested, policy.default_model if policy else None)
        except DefaultModelPending as exc:
            raise pending_error(exc.progress)
        except ModelUnusable as exc:
            raise ApiError(404, public_text(str(exc)), param="model", code="model_unusable")
        except ModelNotFound as exc:
            raise ApiError(404, str(exc), param="model", code="model_not_found")

    def acquire(self, name: str) -> Lease:
        """A lease on a node serving the model; 404 if it left the catalog, 503 if it cannot be loaded now."""
        try:
            return self.residency.acquire(name)
        except UnknownModel:
            raise ApiError(404, f"unknown model '{name}'", param="model", code="model_not_found")
        except ModelLoadFailed as exc:
            # The reason may hold the runner's traceback and the model's path: the admin reads those in the log
            # and on the dashboard, the caller gets the exception's last line with file names only.
            raise ApiError(503, f"model '{name}' could not be loaded: {public_text(exc.reason.partition(RUNNER_LOG_MARK)[0])}",
                           code="model_load_failed",
                           err_type="unavailable_error", headers={"Retry-After": _retry_after(exc.retry_after_s, 10)})
        except NotEnoughMemory as exc:
            raise ApiError(503, public_text(str(exc)), code="not_enough_memory", err_type="unavailable_error",
                           headers={"Retry-After": "30"})

    def delete_model(self, name: str) -> Path:
        """Delete a model file of the models folder; 404 if unknown, 409 for the embedded model or while it serves."""
        try:
            return self.catalog.delete(name, self.residency)
        except ModelNotFound:
            raise ApiError(404, f"model '{name}' not found", param="model", code="model_not_found")
        except ModelEmbedded:
            raise ApiError(409, f"'{name}' is Hearth's embedded default model: it is not deleted", code="model_embedded")
        except ModelBusy as exc:
            raise ApiError(409, f"'{name}' is busy ({exc}); delete it when it is idle", code="model_busy")

    def model_list(self) -> list[dict]:
        """/v1/models: servable models with their state, plus aliases."""
        states = {m["name"]: m for m in self.residency.status()}
        aliases = self.catalog.aliases()
        out = []
        for name, spec in self.catalog.model_specs().items():
            st = states.get(name, {})
            out.append({"id": name, "object": "model", "created": 0, "owned_by": "hearth",
                        "hearth": {"state": st.get("state", ModelState.UNLOADED), "policy": spec.policy,
                                   "estimate_bytes": spec.estimate_bytes,
                                   "aliases": sorted(a for a, n in aliases.items() if n == name)}})
        for alias, name in sorted(aliases.items()):
            out.append({"id": alias, "object": "model", "created": 0, "owned_by": "hearth",
                        "hearth": {"alias_of": name}})
        return out


def _retry_after(seconds: float | None, default: int) -> str:
    """A Retry-After value: whole seconds, at least 1, or the default where nothing better is known."""
    return str(max(1, math.ceil(seconds)) if seconds is not None else default)
