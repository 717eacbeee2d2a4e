"""What the fingerprint needs of SGLang's serving settings (sglang==0.5.23's `ServerArgs` names), and the seam
where SGLang changes the weights in place (`update_weights_from_*`). Part of the one door to SGLang
(`sglang_kvrep.compat`); the fingerprint itself is `sglang_kvrep.fingerprint` (no SGLang in it)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

KV_SERVING_FLAGS = (
    "quantization", "quantization_param_path", "modelopt_quant", "dtype", "kv_cache_dtype", "load_format",
    "json_model_override_args", "context_length", "revision", "tp_size", "pp_size", "dp_size",
    "enable_dp_attention", "attn_cp_size", "ep_size", "moe_dense_tp_size", "enable_lora", "max_lora_rank",
    "lora_target_modules",
)
"""`ServerArgs` settings that change the KV a prompt produces (the weights, their numerics, RoPE, how heads are
split over ranks, which adapters apply). The page size and the pool's geometry and layout are read from the
live pool instead (`SchedulerView.fingerprint_fields`)."""

WEIGHT_UPDATE_KINDS = ("disk", "tensor", "distributed", "ipc")
_UPDATER = "sglang.srt.managers.scheduler_components.weight_updater.SchedulerWeightUpdaterManager"
WEIGHT_UPDATE_HOOKS = {kind: f"{_UPDATER}.update_weights_from_{kind}" for kind in WEIGHT_UPDATE_KINDS}
"""Hook targets: every in-place weight update of a scheduler goes through one of these (scheduler thread)."""


def kv_serving_flags(server_args: Any) -> dict[str, object]:
    """The KV-changing settings of `server_args`, by name (a setting this SGLang lacks reads as None)."""
    return {name: getattr(server_args, name, None) for name in KV_SERVING_FLAGS}


def lora_adapters(server_args: Any) -> list[tuple[str, str]]:
    """(name, path) of every adapter given with `--lora-paths`, in any of SGLang's forms: `path`, `name=path`,
    a JSON object / dict with `lora_name` and `lora_path`, a {name: path} dict, or resolved `LoRARef`s."""
    paths = getattr(server_args, "lora_paths", None) or []
    if isinstance(paths, dict):
        return [(str(k), str(v)) for k, v in paths.items()]
    out = []
    for item in paths:
        if isinstance(item, str):
            name, _, path = item.partition("=") if "=" in item else (item, "", item)
            out.append((name, path))
        elif isinstance(item, dict):
            out.append((str(item.get("lora_name")), str(item.get("lora_path"))))
        else:
            out.append((str(getattr(item, "lora_name", None)), str(getattr(item, "lora_path", None))))
    return out


def rope_in_effect(model_config: Any) -> Optional[dict]:
    """The RoPE settings of a loaded model (after `--json-model-override-args`), or None when unknown."""
    hf = getattr(model_config, "hf_config", None)
    if hf is None:
        return None
    text_config = getattr(hf, "text_config", None) or hf
    return {"rope_scaling": getattr(text_config, "rope_scaling", None),
            "rope_theta": getattr(text_config, "rope_theta", None),
            "max_position_embeddings": getattr(text_config, "max_position_embeddings", None)}


@dataclass(frozen=True)
class WeightUpdate:
    """A weight update SGLang finished (successfully) on a scheduler."""

    scheduler: Any
    kind: str
    """One of `WEIGHT_UPDATE_KINDS`."""
    model_path: Optional[str]
    """The folder the weights came from ("disk" updates), else None."""
    weight_version: Optional[str]
    succeeded: bool
    """False: the weights may or may not have changed (SGLang reports a failure also when the weights changed but
    the cache could not be flushed, and rolls a failed disk load back)."""


def finished_weight_update(kind: str, result: Any, manager: Any, recv_req: Any) -> WeightUpdate:
    """What an `update_weights_from_<kind>` call (its manager, request and result) did."""
    return WeightUpdate(scheduler=getattr(manager, "scheduler", None), kind=kind,
                        model_path=getattr(recv_req, "model_path", None) if kind == "disk" else None,
                        weight_version=getattr(recv_req, "weight_version", None),
                        succeeded=bool(getattr(result, "success", False)))


def parse_server_args(argv: list[str]) -> Any:
    """SGLang's `ServerArgs` from `sglang.launch_server` flags, parsed as the launcher does, unresolved (what the
    scheduler reads the fingerprint's flags from; tests and tools use it without starting a server)."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return ServerArgs.from_cli_args(parser.parse_args(argv))
