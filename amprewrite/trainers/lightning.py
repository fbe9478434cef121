"""A Lightning precision plugin that trains with amprewrite's plan instead of ``torch.autocast``.

``Trainer(precision="16-mixed"/"bf16-mixed")`` runs every step inside ``torch.autocast`` and, in
fp16, with ``torch.amp.GradScaler``. Autocast recasts the matmuls that amprewrite's plan kept in
fp32 (a model whose values pass 65504 gives inf), and torch's scaler skips every step of a
forward that outgrew its plan. ``AmpRewritePrecision`` is the plugin to pass instead: it compiles
the LightningModule's networks with the amprewrite backend, runs the steps without autocast,
and in fp16 scales the loss with :class:`amprewrite.GradScaler`, whose ``update`` re-plans after
an overflow. Lightning's own fp16 recipe (unscale before clipping, skip a non-finite step, the
scaler's state in the checkpoint) is kept: the plugin is Lightning's ``MixedPrecision`` with the
autocast taken out and the scaler replaced.

``AmpRewritePrecision("bf16", params="low")`` also stores the weights the plan reads low in the
networks (:func:`amprewrite.compile.low_params.store_low`) and makes each optimizer
``configure_optimizers`` returns an :func:`amprewrite.optimizer` with the same class, groups
and hyperparameters (its schedulers drive the new one's learning rate); gradient clipping and
the fp16 scaler work with it.

    >>> import lightning, amprewrite.trainers.lightning as al  # doctest: +SKIP
    >>> trainer = lightning.Trainer(plugins=[al.AmpRewritePrecision("bf16")])  # doctest: +SKIP

**Both package names.** The ``lightning`` package installs Lightning as ``lightning.pytorch``;
the ``pytorch_lightning`` package installs the same code under that name, with classes of its
own, and each Trainer accepts only a plugin that is an instance of its own ``Precision``
(``pytorch_lightning.Trainer`` refused a plugin of ``lightning.pytorch``'s with
``MisconfigurationException: Found invalid type for plugin``, issue 65). So the plugin
subclasses the ``MixedPrecision`` of every package name installed, and runs each of
Lightning's hooks as the package whose Trainer it serves has it (found from the
LightningModule it is given): ``lightning.Trainer`` and ``pytorch_lightning.Trainer`` both
take it.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Generator, Iterable, Mapping
from typing import Any, NamedTuple

import torch

from ..compile.backend import backend
from ..compile.low_params import check_params, from_torch, store_low
from ..compile.optimizer import Optimizer
from ..compile.scaler import GradScaler
from .inner import AUTO, inner_for

__all__ = ["AmpRewritePrecision"]

_LIGHTNING = {"bf16": "bf16-mixed", "fp16": "16-mixed"}
_ALIASES = {"bf16": "bf16", "bfloat16": "bf16", "bf16-mixed": "bf16", torch.bfloat16: "bf16",
            "fp16": "fp16", "float16": "fp16", "16-mixed": "fp16", torch.float16: "fp16"}


class _Package(NamedTuple):
    """What the plugin needs of one of Lightning's package names."""

    name: str
    mixed: type  # its plugins.precision.MixedPrecision
    precision: type  # its plugins.precision.Precision
    module: type  # its LightningModule
    clip: type  # its utilities.GradClipAlgorithmType


def _installed() -> tuple[_Package, ...]:
    found = []
    for name in ("lightning.pytorch", "pytorch_lightning"):
        try:
            plugins = importlib.import_module(f"{name}.plugins.precision")
            package = importlib.import_module(name)
            utilities = importlib.import_module(f"{name}.utilities")
        except ImportError:
            continue
        found.append(_Package(name, plugins.MixedPrecision, plugins.Precision,
                              package.LightningModule, utilities.GradClipAlgorithmType))
    if not found:
        raise ImportError(
            "amprewrite.trainers.lightning is a Lightning precision plugin, and neither "
            "lightning.pytorch nor pytorch_lightning is installed: pip install lightning "
            "(or pytorch_lightning).")
    return tuple(found)


_PACKAGES = _installed()


class AmpRewritePrecision(*(p.mixed for p in _PACKAGES)):
    """Train a LightningModule with amprewrite in bf16 or fp16: ``Trainer(plugins=[...])``.

    Args:
        dtype: ``"bf16"`` or ``"fp16"`` (also ``torch.bfloat16``/``torch.float16``, or
            Lightning's ``"bf16-mixed"``/``"16-mixed"``).
        device: where the scaler runs (fp16): ``"cuda"`` or ``"cpu"``; by default ``"cuda"``
            where CUDA is available (torch's scaler for an absent device turns itself off).
        options: more options for :func:`amprewrite.backend` (``keep_fp32=[...]``,
            ``overflow=...``, ``inner=``: by default ``"auto"``, ``"eager"`` on a CPU and
            ``"inductor"`` on a GPU, :mod:`amprewrite.trainers.inner`); ``dtype`` comes from
            the argument above.
        modules: which submodules of the LightningModule to compile, given the LightningModule;
            by default each of its direct children that holds parameters (the networks; the
            ``training_step`` around them is user code: logging, losses, Python).
        scaler: an :class:`amprewrite.GradScaler` to use in fp16 (one is made otherwise).
        params: ``"fp32"`` or ``"low"`` (see the module docstring).

    Each module is compiled in place with ``nn.Module.compile`` (as Lightning plugins convert
    modules in place), so parameter names and checkpoint keys stay those of the model. The plugin
    subclasses Lightning's ``MixedPrecision`` (of ``lightning.pytorch`` and of
    ``pytorch_lightning``, where installed) so that ``isinstance`` checks and the fp16 hooks
    (``pre_backward`` scales, ``optimizer_step`` unscales before ``gradient_clip_val`` and skips
    a non-finite step, ``state_dict`` saves the scaler) are Lightning's own, those of the
    package whose Trainer runs it.

    >>> type(AmpRewritePrecision("fp16", device="cpu").scaler).__module__
    'amprewrite.compile.scaler'
    """

    def __init__(self, dtype: str | torch.dtype = "bf16", device: str | None = None,
                 options: Mapping[str, Any] | None = None,
                 modules: Callable[[torch.nn.Module], Iterable[torch.nn.Module]] | None = None,
                 scaler: GradScaler | None = None, params: str = "fp32") -> None:
        name = _ALIASES.get(dtype)
        if name is None:
            raise ValueError(
                f"AmpRewritePrecision(dtype={dtype!r}): the dtype must be 'bf16' or 'fp16' "
                f"(or torch.bfloat16/torch.float16). For fp32 training pass no plugin.")
        if scaler is not None and not isinstance(scaler, GradScaler):
            raise TypeError(
                f"AmpRewritePrecision(scaler=...) takes an amprewrite.GradScaler, got "
                f"{type(scaler).__name__}: torch's scaler skips every step once a forward "
                f"outgrows its plan, amprewrite's re-plans. Make it with "
                f"amprewrite.GradScaler(device).")
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if name == "fp16" and scaler is None:
            scaler = GradScaler(device)
        # Lightning's hooks as this package has them; convert_module and connect find the
        # package of the LightningModule they are given (the Trainer's).
        self._package = _PACKAGES[0]
        self._package.mixed.__init__(self, _LIGHTNING[name], device, scaler)
        self.dtype = name
        self.options = dict(options or {})
        self.options.pop("dtype", None)
        self.modules = modules or _networks
        self.params = check_params(params, "AmpRewritePrecision")

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Compile the networks of ``module`` with the amprewrite backend (in place)."""
        self._package = _serving(module, self._package)
        options = {**self.options, "inner": inner_for(self.options.get("inner", AUTO))}
        compile_with = backend(dtype=self.dtype, **options)
        low = torch.bfloat16 if self.dtype == "bf16" else torch.float16
        for network in self.modules(module):
            if self.params == "low":
                store_low(network, low, self.options.get("keep_fp32", ()))
            network.compile(backend=compile_with)
        return module

    def connect(self, model: torch.nn.Module, optimizers: list, lr_schedulers: list
                ) -> tuple[torch.nn.Module, list, list]:
        """With ``params="low"``: each optimizer an amprewrite.optimizer over the same groups."""
        self._package = _serving(model, self._package)
        if self.params == "low":
            optimizers = [from_torch(o, model) for o in optimizers]
        return model, optimizers, lr_schedulers

    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any],
                       **kwargs: Any) -> Any:
        """Lightning's fp16 step, with the unscale before clipping that Lightning leaves to an
        optimizer that says it unscales itself (amprewrite's unscales what it was not given
        unscaled, so both orders are right)."""
        if self.scaler is None or not isinstance(optimizer, Optimizer):
            return self._package.mixed.optimizer_step(self, optimizer, model=model,
                                                      closure=closure, **kwargs)
        result = closure()
        if result is None and model.automatic_optimization:  # backward skipped
            return None
        self.scaler.unscale_(optimizer)
        self._after_closure(model, optimizer)
        out = self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        return out

    def clip_gradients(self, optimizer: Any, clip_val: int | float = 0.0,
                       gradient_clip_algorithm: Any = None) -> None:
        """Lightning's clipping; amprewrite's optimizer is given unscaled gradients first."""
        algorithm = gradient_clip_algorithm or self._package.clip.NORM
        if isinstance(optimizer, Optimizer):
            return self._package.precision.clip_gradients(self, optimizer, clip_val, algorithm)
        return self._package.mixed.clip_gradients(self, optimizer, clip_val, algorithm)

    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        """No autocast: the precision is in amprewrite's graphs, and autocast would recast it."""
        yield


def _networks(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The direct children of ``module`` that hold parameters."""
    return [child for child in module.children()
            if next(child.parameters(), None) is not None]


def _serving(module: object, current: _Package) -> _Package:
    """The package whose LightningModule ``module`` is (the Trainer's), else ``current``."""
    return next((p for p in _PACKAGES if isinstance(module, p.module)), current)


def _as_served(name: str) -> Callable:
    def hook(self: AmpRewritePrecision, *args: Any, **kwargs: Any) -> Any:
        return getattr(self._package.mixed, name)(self, *args, **kwargs)

    hook.__name__ = hook.__qualname__ = name
    hook.__doc__ = f"Lightning's ``{name}``, as the package whose Trainer runs the plugin has it."
    return hook


# Every other hook of Lightning's MixedPrecision (and its bases) runs as the serving package
# has it: inherited, the first base's would run for the other package's Trainer too, and its
# code calls that package's own functions (trainer.call's callback hooks, its isinstance
# checks of callbacks and enums).
for _name in sorted({name for cls in _PACKAGES[0].mixed.__mro__[:-1] for name, value in
                     vars(cls).items() if callable(value) and not name.startswith("__")}
                    - set(vars(AmpRewritePrecision))):
    setattr(AmpRewritePrecision, _name, _as_served(_name))
del _name
