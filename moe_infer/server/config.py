"""ServeConfig: the `serve` Hydra group (conf/serve/*.yaml); a plain dataclass, no server imports."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
ENGINE_LOOPS = ("process", "thread")


@dataclass
class ServeConfig:
    host: str = "127.0.0.1"  # 0.0.0.0 to listen on every interface
    port: int = 8000
    api_key: Optional[str] = None  # clients send `Authorization: Bearer <key>` (also $MOE_INFER_API_KEY)
    served_model_name: Optional[str] = None  # the `model` clients name; default: the checkpoint folder's name
    max_queued_requests: int = 256  # requests waiting beyond scheduler.max_num_seqs; past it: 429
    retry_after_s: int = 1  # the Retry-After header of a 429
    max_request_bytes: int = 4 << 20  # a larger body is a 413
    max_prompt_tokens: Optional[int] = None  # a longer prompt is a 400; default: max_model_len - 1
    max_n: int = 16  # the largest `n` (and `best_of`) a request may ask for
    max_logprobs: int = 20  # the largest `logprobs` / `top_logprobs`
    drain_timeout_s: float = 30.0  # on shutdown: in-flight requests get this long, then are aborted
    log_level: str = "info"
    access_log: bool = False
    # where the engine loop runs: "process" (its own process, moe_infer/engine/core_proc.py: HTTP work and
    # the engine do not share a GIL) or "thread" (a thread of the server's process, as in an embedding app)
    engine_loop: str = "process"
    # HTTP server processes in front of the one engine core (vLLM's --api-server-count): at saturation one
    # process's per-token work (an event per token per stream, detokenization) is the bound. Needs
    # engine_loop=process. moe_infer/server/multi.py
    api_server_count: int = 1
    # engine_loop=thread: the engine thread gives the GIL up at every kernel launch and waits for it back
    # while HTTP handlers run; CPython's default 5 ms switch interval would make each wait up to 5 ms
    gil_switch_interval_s: float = 0.0005

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"serve.port must be in [0, 65535], got {self.port}")
        for name in ("max_queued_requests", "retry_after_s", "drain_timeout_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"serve.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("max_request_bytes", "max_n"):
            if getattr(self, name) < 1:
                raise ValueError(f"serve.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.gil_switch_interval_s <= 0.1:
            raise ValueError(f"serve.gil_switch_interval_s must be in (0, 0.1], got {self.gil_switch_interval_s}")
        if self.max_logprobs < 0:
            raise ValueError(f"serve.max_logprobs must be >= 0, got {self.max_logprobs}")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ValueError(f"serve.max_prompt_tokens must be >= 1, got {self.max_prompt_tokens}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("serve.api_key must be a non-empty string or null")
        if self.engine_loop not in ENGINE_LOOPS:
            raise ValueError(f"serve.engine_loop must be one of {ENGINE_LOOPS}, got {self.engine_loop!r}")
        if self.api_server_count < 1:
            raise ValueError(f"serve.api_server_count must be >= 1, got {self.api_server_count}")
        if self.api_server_count > 1 and self.engine_loop != "process":
            raise ValueError(f"serve.api_server_count={self.api_server_count} needs serve.engine_loop=process "
                             f"(got {self.engine_loop!r}): the server processes share an engine core process")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"serve.log_level must be one of {LOG_LEVELS}, got {self.log_level!r}")
