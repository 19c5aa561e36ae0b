"""``patch_trainer`` and ``NNStatArguments``: the LogIX-style influence workflow on a HF Trainer.

Re-exported by :mod:`nnstat.integrations.huggingface`. Unlike LogIX, which re-runs
``trainer.train()`` with a dummy optimizer, the passes here are plain loops over the Trainer's
own data pipeline (its collator, column filtering and ``compute_loss``), so training state,
schedulers and checkpoints are never touched.

Example:
    >>> from transformers import Trainer  # doctest: +SKIP
    >>> NNStatTrainer = patch_trainer(Trainer)  # doctest: +SKIP
    >>> trainer = NNStatTrainer(nnstat_args=NNStatArguments("proj"), model=model,
    ...                         train_dataset=train_ds)  # doctest: +SKIP
    >>> trainer.extract_log(); result = trainer.influence(test_ds)  # doctest: +SKIP
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from nnstat.integrations._logpass import (
    PassData,
    build_config,
    eval_mode,
    log_pass,
    open_run,
    probe_filter,
    query_log,
    refinement,
)

from nnstat.curvature.products import batch_len

__all__ = ["NNStatArguments", "patch_trainer"]

_DATA_IDS = ("index", "hash")


def mean_loss_warning(source: str, loss: float, labels: torch.Tensor, samples: int) -> str:
    """The warning of a per-token mean loss nnstat cannot take apart: it names where the loss
    comes from (``source``), what was assumed (the first batch's ``loss`` a mean over its
    ``samples`` samples, so a row is the gradient of mean × batch size) with the label tokens
    each sample holds, what that does to the scores and the fix.

    Example:
        >>> labels = torch.tensor([[1, -100, -100], [1, 2, 3]])
        >>> message = mean_loss_warning("the model's loss", 2.0, labels, 2)
        >>> "(the first batch: 2 × 2). Its samples hold 1, 3 label tokens" in message
        True
    """
    tokens = labels.ne(-100).flatten(1).sum(1).tolist()
    shown = ", ".join(map(str, tokens[:8])) + (", ..." if len(tokens) > 8 else "")
    return (
        f"nnstat: {source} ignores num_items_in_batch and is no cross-entropy averaged over the "
        "label tokens (labels != -100, shifted by one for a causal LM or not); so nnstat "
        f"assumed a mean over the batch's samples: each sample's summed loss is taken as the "
        f"batch's mean loss × its batch size (the first batch: {loss:.6g} × {samples}). Its "
        f"samples hold {shown} label tokens: where that number differs between samples, every "
        "row of a batch is scaled by batch size / label tokens, a factor that differs between "
        "batches, and scores across batches are distorted. Fix: make the loss divide its summed "
        "token losses by its num_items_in_batch argument (nnstat passes 1 and gets the sum): "
        "Trainer(..., compute_loss_func=lambda outputs, labels, num_items_in_batch: "
        "summed_loss(outputs, labels) / num_items_in_batch), or use a model whose loss does"
    )


def label_count(labels: torch.Tensor, shift: bool) -> torch.Tensor:
    """Label tokens a mean token loss averages over: those not ``-100``, after dropping each
    sequence's first label when ``shift`` (HF causal LMs predict token ``t+1`` at ``t``).

    Args:
        labels: integer labels, ``(batch, ...)``.
        shift: whether the loss shifts the labels by one token.

    Returns:
        A 0-d integer tensor (no host read).

    Example:
        >>> int(label_count(torch.tensor([[1, 2, -100], [3, -100, -100]]), shift=False))
        3
    """
    return (labels[..., 1:] if shift else labels).ne(-100).sum()


def _summed_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, shift: bool
) -> torch.Tensor | None:
    """Cross-entropy of ``logits`` summed over the labels not ``-100`` (``None`` where the
    logits do not fit the labels that way)."""
    if shift:
        if labels.ndim < 2 or logits.ndim < 3:
            return None
        logits, labels = logits[..., :-1, :], labels[..., 1:]
    if labels.is_floating_point() or logits.shape[:-1] != labels.shape:
        return None
    flat = logits.reshape(-1, logits.shape[-1]).double()
    return torch.nn.functional.cross_entropy(
        flat, labels.reshape(-1), ignore_index=-100, reduction="sum"
    )


def label_shift(
    loss: torch.Tensor, logits: torch.Tensor | None, labels: torch.Tensor
) -> bool | None:
    """Which labels a mean cross-entropy ``loss`` averaged over: ``False`` the labels as given
    (BERT's masked LM, T5), ``True`` labels shifted by one token (HF causal LMs), ``None``
    neither (a custom loss, or no logits): the summed cross-entropy rebuilt from ``logits``
    must equal ``loss × label_count(labels, shift)``.

    Args:
        loss: the batch's mean loss (0-d).
        logits: the model's logits, ``labels.shape + (classes,)`` (one longer when shifted).
        labels: the batch's integer labels, ``-100`` ignored.

    Returns:
        ``False``, ``True`` or ``None``.

    Example:
        >>> logits, labels = torch.randn(2, 3, 5), torch.tensor([[1, -100, 2], [4, 0, -100]])
        >>> label_shift(torch.nn.functional.cross_entropy(logits.mT, labels), logits, labels)
        False
    """
    if logits is None:
        return None
    for shift in (False, True):
        total = _summed_cross_entropy(logits, labels, shift)
        if total is not None:
            mean_times_count = loss.double() * label_count(labels, shift)
            if bool(torch.isclose(mean_times_count, total, rtol=1e-4)):
                return shift
    return None


@dataclass
class NNStatArguments:
    """What ``patch_trainer``'s Trainer logs and how it scores influence.

    Attributes:
        project: store directory name under ``root_dir``.
        config: ``nnstat.setup`` dictionary or statistic preset name (``"kfac"``...).
        lora: project per-sample gradients to ``rank × rank`` per module (LogIX's name for its
            LoGra projection); ``False`` stores full per-sample gradients.
        ekfac: ``None`` = EK-FAC unless ``config`` names a statistic; ``True`` forces it;
            ``False`` uses ``config``'s statistic or ``raw``.
        rank, init, seed: the projection (``init="pca"`` needs a previous statistics pass).
        root_dir: parent directory of stores.
        name_filter, type_filter: modules to watch (default: every supported one).
        data_id: ``"index"`` (position in the dataset) or ``"hash"`` (content hash of
            ``input_key``).
        input_key, mask_key: batch keys of the inputs and of the padding mask (``None``: no
            mask).
        mode, preconditioner, damping, top_k: defaults of ``influence()`` (see
            ``nnstat.influence.compute_influence_all``).
        track: also add an ``NNStatCallback`` (statistics during ``trainer.train()``), with
            ``callback_options`` as its keyword arguments.
        progress: tqdm bars on the passes (``None``: automatic).
        text_fn: the text the influence explorer (``nnstat view``) shows for a dataset row,
            e.g. ``lambda row: tok.decode(row["input_ids"])``; ``None``: the Trainer's
            ``processing_class.decode`` of ``input_key`` when it has one, else no texts.
            ``extract_log`` saves the training set's texts beside the store, ``influence``
            saves its queries (``viewer/queries/<query_name>``) with theirs.
        query_name: the folder name of the query set ``influence`` saves.

    Raises:
        ValueError: an unknown ``data_id`` or a ``rank`` that is not a positive int.

    Example:
        >>> NNStatArguments("proj", lora=False).effective_rank() is None
        True
    """

    project: str = "nnstat"
    config: dict[str, Any] | str | None = None
    lora: bool = True
    ekfac: bool | None = None
    rank: int = 64
    init: str = "random"
    seed: int = 0
    root_dir: str = "./nnstat_logs"
    name_filter: Any = None
    type_filter: Any = None
    data_id: str = "index"
    input_key: str = "input_ids"
    mask_key: str | None = "attention_mask"
    mode: str = "dot"
    preconditioner: str | None = None
    damping: float | None = None
    top_k: int | None = None
    track: bool = True
    callback_options: dict[str, Any] = field(default_factory=dict)
    progress: bool | None = None
    text_fn: Callable[[Any], str] | None = None
    query_name: str = "queries"

    def __post_init__(self) -> None:
        if self.data_id not in _DATA_IDS:
            raise ValueError(f"data_id must be one of {list(_DATA_IDS)}, got {self.data_id!r}")
        if not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"rank must be a positive int, got {self.rank!r}")

    def effective_rank(self) -> int | None:
        """The projection rank, or ``None`` (full per-sample gradients) when ``lora=False``."""
        return self.rank if self.lora else None


def _training_arguments(nnstat_args: NNStatArguments) -> Any:
    from transformers import TrainingArguments

    out = Path(nnstat_args.root_dir) / f"{nnstat_args.project}-trainer"
    return TrainingArguments(output_dir=str(out), report_to="none")


def patch_trainer(trainer_cls: type) -> type:
    """A subclass of ``trainer_cls`` (``Trainer``, ``Seq2SeqTrainer``, ...) taking
    ``nnstat_args=NNStatArguments(...)`` (or ``args=NNStatArguments(...)`` in place of the
    TrainingArguments) and adding ``extract_log()``, ``influence(query_dataset)`` and
    ``self_influence()``.

    Per-sample losses are each sample's **summed** token losses (``num_items_in_batch=1`` for
    models that take it; otherwise the mean × the label tokens it averaged over, ``labels !=
    -100``, shifted or not as the first batch's logits show; mean × batch size, with a warning,
    for a loss that is neither), so scores match the plain API with a ``reduction="sum"`` loss.
    The passes run the model in eval mode, batch size ``per_device_eval_batch_size``, in dataset
    order.

    Args:
        trainer_cls: a ``transformers.Trainer`` subclass.

    Returns:
        The subclass ``NNStatTrainer``.

    Raises:
        TypeError: ``trainer_cls`` is not a Trainer subclass.

    Example:
        >>> from transformers import Trainer  # doctest: +SKIP
        >>> patch_trainer(Trainer).__name__  # doctest: +SKIP
        'NNStatTrainer'
    """
    from transformers import Trainer

    if not (isinstance(trainer_cls, type) and issubclass(trainer_cls, Trainer)):
        raise TypeError(
            f"patch_trainer expects a transformers.Trainer subclass, got {trainer_cls!r}"
        )

    class NNStatTrainer(trainer_cls):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, nnstat_args: NNStatArguments | None = None, **kwargs: Any):
            args = list(args)
            if isinstance(kwargs.get("args"), NNStatArguments):
                nnstat_args = kwargs.pop("args") if nnstat_args is None else nnstat_args
                kwargs["args"] = _training_arguments(nnstat_args)
            elif len(args) > 1 and isinstance(args[1], NNStatArguments):
                nnstat_args = args[1] if nnstat_args is None else nnstat_args
                args[1] = _training_arguments(nnstat_args)
            if nnstat_args is None:
                raise TypeError("pass nnstat_args=NNStatArguments(project=...)")
            if not isinstance(nnstat_args, NNStatArguments):
                raise TypeError(f"nnstat_args must be NNStatArguments, got {nnstat_args!r}")
            super().__init__(*args, **kwargs)
            self.nnstat_args = nnstat_args
            self.nnstat_run: Any = None
            self._nnstat_honours_items: bool | None = None  # see _nnstat_sums_items
            self._nnstat_shift: bool | str | None = None  # see _nnstat_mean_count
            self.nnstat_callback: Any = None
            if nnstat_args.track:
                from nnstat.integrations._hf_callback import watch_trainer

                self.nnstat_callback = watch_trainer(self, **nnstat_args.callback_options)

        # ------------------------------------------------------------ plumbing
        def _nnstat_open(self, loader: Any) -> Any:
            if self.nnstat_run is None:
                a = self.nnstat_args
                name_filter = probe_filter(
                    self.model,
                    next(iter(loader)),
                    self._nnstat_sum_loss,
                    a.name_filter,
                    a.type_filter,
                    stacklevel=5,
                )
                config = build_config(a.config, ekfac=a.ekfac, loss_reduction="sum")
                self.nnstat_run = open_run(
                    self.model,
                    a.project,
                    a.root_dir,
                    config,
                    rank=a.effective_rank(),
                    init=a.init,
                    seed=a.seed,
                    name_filter=name_filter,
                    type_filter=a.type_filter,
                )
            return self.nnstat_run

        def _nnstat_sum_loss(self, inputs: dict[str, Any]) -> torch.Tensor:
            inputs = self._prepare_inputs(inputs)
            if "labels" not in inputs:
                return self.compute_loss(self.model, inputs) * self._nnstat_batch_len(inputs)
            if self._nnstat_sums_items(inputs):
                # copies: compute_loss pops "labels" when it has a compute_loss_func
                loss = self.compute_loss(self.model, dict(inputs), num_items_in_batch=1)
                if getattr(self.args, "average_tokens_across_devices", False):
                    # compute_loss multiplies by the process count in that case
                    loss = loss / max(1, self.accelerator.num_processes)
                return loss
            return self.compute_loss(self.model, dict(inputs)) * self._nnstat_mean_count(inputs)

        def _nnstat_sums_items(self, inputs: dict[str, Any]) -> bool:
            """Whether the model's loss divides by ``num_items_in_batch`` (then ``1`` makes it
            the sum). The Trainer's ``model_accepts_loss_kwargs`` only says that ``forward``
            takes ``**kwargs``: BERT's and T5's losses take them and still average, so the
            first batch is asked once (in eval mode, no graph): a loss that honours it halves
            when ``num_items_in_batch`` doubles. A ``compute_loss_func`` is always passed it."""
            takes_items = getattr(self, "model_accepts_loss_kwargs", False)
            if not (takes_items or getattr(self, "compute_loss_func", None) is not None):
                return False
            if self._nnstat_honours_items is None:
                with torch.no_grad():
                    one = self.compute_loss(self.model, dict(inputs), num_items_in_batch=1)
                    two = self.compute_loss(self.model, dict(inputs), num_items_in_batch=2)
                self._nnstat_honours_items = bool(torch.isclose(one, 2 * two, rtol=1e-4))
            return self._nnstat_honours_items

        def _nnstat_mean_count(self, inputs: dict[str, Any]) -> torch.Tensor | int:
            """The number of terms a loss that averages (ignores ``num_items_in_batch``) is the
            mean of, so that mean × count is the batch's summed token loss: its label tokens
            (``labels != -100``, after a causal LM's one-token shift), or the batch size when
            the first batch's loss is no cross-entropy over them (see `label_shift`)."""
            if self._nnstat_shift is None:
                with torch.no_grad():
                    loss, outputs = self.compute_loss(self.model, dict(inputs), return_outputs=True)
                logits = outputs.get("logits") if isinstance(outputs, dict) else None
                labels = inputs["labels"]
                shift = label_shift(loss, logits, labels)
                # integer labels per token may hold -100s: counts differ between samples
                if shift is None and labels.ndim > 1 and not labels.is_floating_point():
                    message = mean_loss_warning(
                        self._nnstat_loss_source(),
                        float(loss),
                        labels,
                        self._nnstat_batch_len(inputs),
                    )
                    warnings.warn(message, stacklevel=4)
                self._nnstat_shift = "batch" if shift is None else shift
            if self._nnstat_shift == "batch":
                return self._nnstat_batch_len(inputs)
            return label_count(inputs["labels"], self._nnstat_shift)

        def _nnstat_loss_source(self) -> str:
            """Where the Trainer's loss comes from, as a warning names it."""
            if getattr(self, "compute_loss_func", None) is not None:
                return "the Trainer's compute_loss_func"
            owner = next(c for c in type(self).__mro__ if "compute_loss" in vars(c))
            if owner is not Trainer:
                return f"{owner.__name__}.compute_loss"
            return f"the model's loss ({type(self.model).__name__}.forward)"

        def _nnstat_batch_len(self, batch: Any) -> int:
            """Samples in ``batch``: dim 0 of its ``input_key`` tensor, else of its first
            tensor (``pixel_values`` of a vision model)."""
            key = self.nnstat_args.input_key
            return int(batch[key].shape[0]) if key in batch else batch_len(batch)

        def _nnstat_data(self, loader: Any) -> PassData:
            a = self.nnstat_args

            def ids_fn(batch: Any, start: int) -> Any:
                if a.data_id == "hash":
                    # asked for explicitly: a 1-D integer tensor alone would be taken as ids
                    from nnstat.store.ids import content_ids

                    if a.input_key not in batch:
                        raise KeyError(
                            f"data_id='hash' hashes the batch's {a.input_key!r}, which it "
                            f"does not hold (keys: {sorted(batch)}); pass "
                            "NNStatArguments(input_key=<the model's input>)"
                        )
                    return content_ids(batch[a.input_key])
                return list(range(start, start + self._nnstat_batch_len(batch)))

            def mask_fn(batch: Any) -> Any:
                return None if a.mask_key is None else batch.get(a.mask_key)

            return PassData(
                self.model,
                loader,
                self._nnstat_sum_loss,
                ids_fn=ids_fn,
                mask_fn=mask_fn,
                progress=a.progress,
            )

        def _nnstat_loader(self, dataset: Any) -> Any:
            return self.get_eval_dataloader(dataset)

        # ------------------------------------------------------------ workflow
        def extract_log(self, dataset: Any = None, overwrite: bool = False) -> Any:
            """Log projected per-sample gradients (and the statistics the config asks for) of
            ``dataset`` (default: the training set) to the store; returns the ``Run``.

            A store logged with other weights (``extract_log()`` → ``train()`` →
            ``extract_log()``) is refused; ``overwrite=True`` replaces it."""
            from nnstat.store.errors import ModelChangedError, add_note

            dataset = self.train_dataset if dataset is None else dataset
            if dataset is None:
                raise ValueError("extract_log() needs a train_dataset (or a dataset argument)")
            loader = self._nnstat_loader(dataset)
            run = self._nnstat_open(loader)
            run.overwrite = run.overwrite or overwrite
            try:
                log_pass(run, self._nnstat_data(loader))
            except ModelChangedError as e:
                add_note(
                    e,
                    "With a Trainer: trainer.extract_log(overwrite=True) replaces the store, or "
                    "NNStatArguments(project=<new name>) logs into a new one.",
                )
                raise
            self._nnstat_save_texts(dataset, run.path)
            return run

        # ------------------------------------------------------------ explorer texts
        def _nnstat_text_fn(self) -> Callable[[Any], str] | None:
            a = self.nnstat_args
            if a.text_fn is not None:
                return a.text_fn
            decode = getattr(getattr(self, "processing_class", None), "decode", None)
            if decode is None:
                return None
            return lambda row: decode(row[a.input_key])

        def _nnstat_save_texts(self, dataset: Any, folder: Any) -> None:
            """Each row's text beside ``folder`` (a store or a query set), for the explorer;
            the folder's ids are in dataset order (the passes do not shuffle)."""
            from nnstat.viewer.examples import read_query_ids, save_examples

            text_fn = self._nnstat_text_fn()
            if text_fn is None:
                return
            folder = Path(folder)
            if (folder / "query.json").is_file():
                ids = read_query_ids(folder)
            else:
                from nnstat.store import GradientStore

                ids = GradientStore(folder).ids
            if len(ids) != len(dataset):
                warnings.warn(
                    f"nnstat: {folder} holds {len(ids)} rows, the dataset {len(dataset)}: no "
                    "texts saved for the explorer (extract_log(overwrite=True) logs it afresh)",
                    stacklevel=3,
                )
                return
            save_examples(folder, ids, texts=[str(text_fn(dataset[i])) for i in range(len(ids))])

        def _nnstat_query(self, dataset: Any) -> Any:
            if self.nnstat_run is None:
                raise RuntimeError("call extract_log() before influence()/self_influence()")
            loader = self._nnstat_loader(dataset)
            return query_log(self.nnstat_run, self._nnstat_data(loader))

        def influence(self, query_dataset: Any = None, refine: Any = None, **overrides: Any) -> Any:
            """Scores of every training example for every query (``InfluenceResult``, or
            ``TopKInfluence`` with ``top_k``). ``overrides``: ``mode``, ``preconditioner``,
            ``damping``, ``top_k``. ``refine=5`` refines the scores with 5 conjugate-gradient
            steps on the exact Hessian of the trainer's loss over its training set (or pass a
            `nnstat.influence.Refinement`)."""
            from nnstat.influence import compute_influence_all

            query_dataset = self.eval_dataset if query_dataset is None else query_dataset
            if query_dataset is None:
                raise ValueError("influence() needs a query dataset (or an eval_dataset)")
            options = self._nnstat_options(
                overrides, ("mode", "preconditioner", "damping", "top_k")
            )
            log = self._nnstat_query(query_dataset)
            if self._nnstat_text_fn() is not None:
                from nnstat.viewer.examples import save_queries

                folder = save_queries(log, self.nnstat_run.path, self.nnstat_args.query_name)
                self._nnstat_save_texts(query_dataset, folder)
            with eval_mode(self.model):
                refinement_ = self._nnstat_refinement(refine, query_dataset)
                return compute_influence_all(
                    log, self.nnstat_run.path, refine=refinement_, **options
                )

        def self_influence(self, dataset: Any = None, refine: Any = None, **overrides: Any) -> Any:
            """Self-influence ``g_iᵀ(H+λI)⁻¹g_i`` of each training example (``dataset=None``) or
            of each example of ``dataset`` (``SelfInfluenceResult``); ``refine`` as in
            `influence`."""
            from nnstat.influence import compute_self_influence

            options = self._nnstat_options(overrides, ("preconditioner", "damping"))
            if self.nnstat_run is None:
                raise RuntimeError("call extract_log() before self_influence()")
            with eval_mode(self.model):
                if dataset is None:
                    refinement_ = self._nnstat_refinement(refine, None)
                    return compute_self_influence(
                        self.nnstat_run.path, refine=refinement_, **options
                    )
                log = self._nnstat_query(dataset)
                refinement_ = self._nnstat_refinement(refine, dataset)
                return compute_self_influence(
                    log, self.nnstat_run.path, refine=refinement_, **options
                )

        def _nnstat_refinement(self, refine: Any, query_dataset: Any) -> Any:
            """``refine=`` as a Refinement on the trainer's loss and training set (queries:
            ``query_dataset``, or the training set itself); the data only when refining."""
            if refine is None or not isinstance(refine, int):
                return refinement(refine, None, None, "sum")
            if self.train_dataset is None:
                raise ValueError("refinement needs the trainer's train_dataset")
            train = self._nnstat_data(self._nnstat_loader(self.train_dataset))
            query = (
                train
                if query_dataset is None
                else self._nnstat_data(self._nnstat_loader(query_dataset))
            )
            return refinement(refine, train, query, "sum")

        def _nnstat_options(self, overrides: dict[str, Any], keys: tuple[str, ...]) -> dict:
            unknown = sorted(set(overrides) - set(keys))
            if unknown:
                raise TypeError(f"unknown option(s) {unknown}; valid: {list(keys)}")
            return {k: overrides.get(k, getattr(self.nnstat_args, k)) for k in keys} | {
                "progress": self.nnstat_args.progress
            }

    NNStatTrainer.__name__ = NNStatTrainer.__qualname__ = f"NNStat{trainer_cls.__name__}"
    return NNStatTrainer
