"""What `hearth runner` was started with: llama-server's flags as one frozen value."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from app.engine.model_config import ModelConfig
from app.engine.speculation import NO_SPEC, SpecConfig
from app.gguf_meta import audio_projector_type
from app.policy import Mode
from app.protocols.audio import AudioLimits
from app.protocols.openai import MAX_IMAGE_BYTES


@dataclass(frozen=True)
class ImageLimits:
    """What one request's images may be (llama-server has no such limits; these keep a household box safe)."""

    max_bytes: int = MAX_IMAGE_BYTES  # what a generation's body limit makes room for (app.protocols.openai)
    max_pixels: int = 8192 * 8192  # an image's own size, read from its header before any pixel is decoded
    max_images: int = 16
    # Pixels a request's images may decode to, all together, after the reduction on decode a format allows (a JPEG's
    # DCT scaling); a request over it is refused before its first pixel is decoded. 8.4 MP: a 4K screenshot as PNG,
    # or two 12 MP phone photos (JPEGs decoded at half their sides); one 8192² 16-bit PNG (520 KB sent) grew the
    # runner by 770 MB for 2.8 s without it (app.devtools.engine.image_memory measures it).
    max_request_pixels: int = 1 << 23
    # http(s) image URLs are fetched only when this is on (--image-url-fetch): off, a prompt cannot make
    # the server reach into the household's network.
    fetch_urls: bool = False
    # The whole fetch (resolve, connect, every redirect, the body) within this; only public addresses are
    # reached, and these hosts on the LAN or this machine besides (app.netguard.HostPolicy's syntax).
    fetch_timeout_s: float = 10.0
    fetch_allowed_hosts: str = ""


@dataclass(frozen=True)
class RunnerConfig:
    """Everything `hearth runner` was started with."""

    model: ModelConfig
    mode: str = Mode.CONTINUOUS.value
    token_budget: int | None = None
    max_waiting: int = 64
    # Tokens generated when a request names no limit (None: until the context is full, llama-server's -n -1).
    default_max_tokens: int | None = 512
    alias: str | None = None
    prefix_cache: bool = True
    # llama-server's --cache-ram in MiB (-1 no limit, 0 off): evicted prefix-cache entries kept in host RAM.
    # Off unless asked: the model must be loaded with ModelConfig.kv_transfer for it (the CLI does both).
    cache_ram_mib: int = 0
    # The disk tier's folder (None: off) and budget in MiB (-1: no limit): cached prefixes that survive restarts.
    cache_disk: str | None = None
    cache_disk_mib: int = 4096
    cache_disk_max_age_s: float | None = None  # entries unused this long are deleted (None: never)
    # Sampling defaults for requests that name none (llama-server's --temp, --seed).
    default_temperature: float | None = None
    default_seed: int | None = None
    # Clients must send one of these as a bearer token or X-Api-Key (empty: no key asked).
    api_keys: tuple[str, ...] = ()
    metrics: bool = True
    slots: bool = True
    # Jinja text that replaces the model's own chat template.
    chat_template: str | None = None
    # Embedding and reranking modes (llama-server's --embedding, --pooling, --reranking).
    embedding: bool = False
    pooling: str | None = None
    reranking: bool = False
    # llama-server's --cors-origins: "*" echoes any Origin (with credentials), "localhost" loopback ones only,
    # "none" no CORS at all (runners started by `hearth serve`: no web page may read their answers).
    cors_origins: str = "*"
    # llama-server's --verbose: chat answers carry `__verbose` with the rendered prompt.
    verbose: bool = False
    # llama-server's --reasoning: "on"/"off" set the templates' enable_thinking; "auto" leaves it to them.
    reasoning: str = "auto"
    # llama-server's --reasoning-format: "none" leaves thoughts in content; the others split them out.
    reasoning_format: str = "auto"
    # llama-server's --reasoning-budget (thinking tokens when a request names none; -1 unlimited, 0 none)
    # and --reasoning-budget-message (forced before the end of a thought whose budget is spent).
    reasoning_budget: int = -1
    reasoning_budget_message: str = ""
    # llama-server's --grammar / --grammar-file: the GBNF of requests that bring no constraint of their own.
    grammar: str | None = None
    # llama-server's --tags: listed on /models.
    tags: tuple[str, ...] = ()
    # llama-server's --spec-type and friends: drafting from the context, switched by load.
    spec: SpecConfig = NO_SPEC
    # llama-server's -md / --spec-draft-model with -ngld: the draft model of --spec-type draft-simple, loaded with
    # the target's slots and n_ctx (app/engine/draft_model.py); None: no draft model.
    draft_model: ModelConfig | None = None
    # llama-server's --mmproj: the model's multimodal projector (vision), loaded with libmtmd; None: text only.
    mmproj: str | None = None
    images: ImageLimits = ImageLimits()
    audio: AudioLimits = AudioLimits()

    @property
    def audio_limits(self) -> AudioLimits:
        """The audio limits with the encoder window of this runner's projector (the least audio libmtmd can take)."""
        return self.audio.for_projector(_audio_projector_type(self.mmproj))

    @property
    def model_name(self) -> str:
        """The name clients see in responses (of several comma-separated aliases, the first in order, as llama-server)."""
        return min(self.aliases) if self.aliases else Path(self.model.path).name

    @property
    def aliases(self) -> list[str]:
        """The names given with --alias (llama-server takes several, comma-separated)."""
        return [a.strip() for a in (self.alias or "").split(",") if a.strip()]


@lru_cache(maxsize=8)
def _audio_projector_type(mmproj: str | None) -> str | None:
    return audio_projector_type(mmproj)
