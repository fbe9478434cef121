"""torchtitan with amprewrite's plan, from torchtitan's own launcher.

torchtitan names a config registry by module path (``--module``), so this module is one: it
holds every config function of torchtitan's own registries (``llama3_debugmodel``,
``llama3_8b``, ...), built as torchtitan builds it, after :func:`install` and with
``compile.backend = "amprewrite"`` (and ``NAME_float16``: ``NAME`` with
``training.mixed_precision_param = "float16"``, which torchtitan's command line does not
offer)::

    torchrun --nproc_per_node 8 -m torchtitan.train \\
        --module amprewrite.trainers.torchtitan --config llama3_8b --compile.enable

What :func:`install` does, in this process, and nothing else: torchtitan's ``apply_fsdp``
shards with :func:`amprewrite.fully_shard` (it takes torchtitan's ``MixedPrecisionPolicy`` and
``[norm, lm_head]`` list as they come: the plan's dtype is its ``param_dtype``, torchtitan's
``training.mixed_precision_param``, and the backend plans each block in it); torchtitan's
regional-inductor scoop for FlexAttention models lets amprewrite's backends through (it
refuses every backend but inductor and aot_eager); and ``amprewrite-eager`` and
``amprewrite-aot_eager`` are registered, the backend with those inner compilers. It checks
torchtitan's version first: the names it replaces are torchtitan's private ones.

``AMPREWRITE_TORCHTITAN_CPU=1`` (or ``install(cpu=True)``) adds what a run on a CPU with gloo
needs, a test convenience a GPU run does not want: torchtitan's device type ``"cpu"``, FSDP
reductions as plain sums (gloo has no ``PREMUL_SUM``), and FlexAttention's refusal of inputs
that require grad on CPU skipped (torch's, not torchtitan's).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable

from ..errors import PolicyError

__all__ = ["SUPPORTED", "install"]

# torchtitan releases whose private names install() replaces (major, minor).
SUPPORTED = ((0, 3),)
_INSTALL = ("torchtitan is not installed: pip install 'torchtitan==0.3.*' (it pulls in "
            "packages that conflict with some environments: a venv of its own is safest).")
_installed = {"common": False, "cpu": False}  # what install() has done in this process


def _version() -> tuple[int, int]:
    try:
        from importlib.metadata import version

        text = version("torchtitan")
    except Exception:
        raise PolicyError(f"amprewrite.trainers.torchtitan: {_INSTALL}") from None
    parts = [int(p) for p in text.split("+")[0].split(".")[:2] if p.isdigit()]
    major, minor = [*parts, 0, 0][:2]
    return major, minor


def install(*, cpu: bool | None = None) -> None:
    """Make torchtitan's own training (``torchtitan.train``, its config, its loop) use
    amprewrite's plan; idempotent. ``cpu``: also what a CPU run with gloo needs (default:
    ``AMPREWRITE_TORCHTITAN_CPU=1``). See the module docstring.

    >>> SUPPORTED  # the torchtitan releases it patches
    ((0, 3),)
    """
    found = _version()
    if found not in SUPPORTED:
        shown = ", ".join(f"{a}.{b}" for a, b in SUPPORTED)
        raise PolicyError(
            f"amprewrite.trainers.torchtitan supports torchtitan {shown}, found "
            f"{found[0]}.{found[1]}: install() replaces names private to those releases. "
            f"Install a supported torchtitan (pip install 'torchtitan=={SUPPORTED[-1][0]}."
            f"{SUPPORTED[-1][1]}.*'), or shard with amprewrite.fully_shard and compile with "
            "backend='amprewrite' in your own parallelize function.")
    cpu = os.environ.get("AMPREWRITE_TORCHTITAN_CPU", "") not in ("", "0") if cpu is None else cpu
    if not _installed["common"]:
        _install_common()
        _installed["common"] = True
    if cpu and not _installed["cpu"]:
        _install_cpu()
        _installed["cpu"] = True


def _install_common() -> None:
    import torch.distributed as dist
    import torchtitan.distributed.compile as tt_compile
    import torchtitan.distributed.fsdp as tt_fsdp
    from torch._dynamo.backends.registry import _BACKENDS, register_backend

    from ..compile.backend import backend
    from ..compile.sharding import fully_shard

    tt_fsdp.fully_shard = _sharding(fully_shard)
    if not hasattr(dist, "set_timeout"):
        # torchtitan 0.3's trainer calls torch.distributed.set_timeout after the first step, a
        # function newer than torch 2.13 (which has ProcessGroup.set_timeout): added here.
        def set_timeout(timeout, group=None):
            (group or dist.distributed_c10d._get_default_group()).set_timeout(timeout)

        dist.set_timeout = set_timeout
    scoop = tt_compile._maybe_regional_inductor_backend

    @functools.wraps(scoop)
    def amprewrite_through(model, backend):
        if isinstance(backend, str) and backend.startswith("amprewrite"):
            return backend  # the plan's graph compiles its flex region itself
        return scoop(model, backend)

    tt_compile._maybe_regional_inductor_backend = amprewrite_through
    for inner in ("eager", "aot_eager"):
        if f"amprewrite-{inner}" not in _BACKENDS:
            register_backend(backend(inner=inner), name=f"amprewrite-{inner}")


def _sharding(fully_shard: Callable) -> Callable:
    @functools.wraps(fully_shard)
    def shard(module, *args, **kwargs):
        out = fully_shard(module, *args, **kwargs)
        if _installed["cpu"]:
            for m in (module if isinstance(module, list) else [module]):
                if hasattr(m, "set_force_sum_reduction_for_comms"):
                    m.set_force_sum_reduction_for_comms(True)
        return out

    return shard


class _CpuDevice:
    """``torch.cpu`` with the memory queries torchtitan's metrics make of a CUDA-like device
    module (a CPU has none of them: the figures read as unknown)."""

    def __getattr__(self, name: str) -> object:
        import torch

        return getattr(torch.cpu, name)

    @staticmethod
    def get_device_name(device: object = None) -> str:
        return "cpu"

    @staticmethod
    def get_device_properties(device: object = None) -> object:
        import types

        return types.SimpleNamespace(name="cpu", total_memory=1)

    @staticmethod
    def memory_stats(device: object = None) -> dict:
        return {}

    @staticmethod
    def reset_peak_memory_stats(device: object = None) -> None:
        return None

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def current_device() -> int:
        return 0  # an index, as CUDA's (torch.cpu says "cpu")


def _install_cpu() -> None:
    import torch.nn.attention.flex_attention as fa
    import torchtitan.tools.utils as tt_utils

    device = _CpuDevice()
    tt_utils.device_type, tt_utils.device_module = "cpu", device
    for name, mod in list(sys.modules.items()):
        if name.startswith("torchtitan.") and getattr(mod, "device_type", None) == "cuda":
            mod.device_type = "cpu"
            if hasattr(mod, "device_module"):
                mod.device_module = device
    validate = fa._validate_device

    def validate_off_cpu(query, key, value):
        return None if query.device.type == "cpu" else validate(query, key, value)

    fa._validate_device = validate_off_cpu


def __getattr__(name: str) -> Callable[[], object]:
    """torchtitan's config function ``name`` (from any of its model registries), after
    :func:`install`, with ``compile.backend = "amprewrite"`` where the config says inductor.
    ``NAME_float16`` (``_bfloat16``, ``_float32``) is torchtitan's ``NAME`` with
    ``training.mixed_precision_param`` set so: torchtitan 0.3's command line accepts only
    bfloat16 and float32 there, its config and its FSDP policy take float16 too.
    Any other name is an AttributeError, as for a module's missing attribute (tools that probe
    modules, pytest's collection among them, ask for names of their own)."""
    if name.startswith("_") or importlib.util.find_spec("torchtitan") is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}"
                             + ("" if name.startswith("_") else f" ({_INSTALL})"))
    from torchtitan.models import _supported_models

    base, param = name, None
    for dtype in ("float16", "bfloat16", "float32"):
        if name.endswith("_" + dtype):
            base, param = name[: -len(dtype) - 1], dtype
    for model in sorted(_supported_models):
        try:
            registry = importlib.import_module(f"torchtitan.models.{model}.config_registry")
        except ImportError:
            continue
        fn = getattr(registry, name, None)
        if fn is None and param is not None:  # NAME_float16: torchtitan's NAME, set so
            fn = getattr(registry, base, None)
        else:
            param = None
        if callable(fn):
            install()

            @functools.wraps(fn)
            def config(fn=fn, param=param):
                built = fn()
                compile_config = getattr(built, "compile", None)
                if compile_config is not None and compile_config.backend == "inductor":
                    compile_config.backend = "amprewrite"
                if param is not None:  # NAME_float16: the command line offers no float16
                    built.training.mixed_precision_param = param
                return built

            return config
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}: no torchtitan config "
                         "function has that name")
