"""BatchedDynamicEmbeddingTables: the dynamic counterpart of FBGEMM's
SplitTableBatchedEmbeddingBagsCodegen (TBE), which TorchRec's sharded lookups
wrap.

One module serves many tables and features with TBE-style inputs (indices,
offsets [F * B + 1], feature -> table map). A training forward deduplicates
keys per table, finds or inserts them in the storage (new keys get their
initial value), gathers and pools; the backward reduces one gradient per
unique key and applies the optimizer to the rows in place (fused: no dense
gradient, no optimizer.step()). In eval mode keys are only looked up.
"""
import warnings
from typing import Dict, Optional, Sequence, Tuple

import torch
from torch import nn

from dynamicemb import rules
from dynamicemb._ops import ops
from dynamicemb.aliases import renamed
from dynamicemb.contiguous import contiguous_as
from dynamicemb.host_copy import HostCopy
from dynamicemb.memory import DynamicEmbBudgetError
from dynamicemb.optimizer import (EmbOptimType, check_weight_decay, checked_hyper_parameters, clipping_bound,
                                  hyper_parameter_updates, optimizer_code, state_start, state_width,
                                  weight_decay_mode_code)
from dynamicemb.options import DynamicEmbTableOptions
from dynamicemb.step_warnings import warn_step
from dynamicemb.storage_protocol import PENDING_PREFETCHES, EmbeddingStorage
from dynamicemb.tiers import make_storage
from dynamicemb.types import (DynamicEmbCheckMode, DynamicEmbPoolingMode, canonical_device, check_finite_weights,
                              int64_score)


def _versions(indices: torch.Tensor, offsets: torch.Tensor):
    """The tensors' version counters (bumped by every in-place change); None
    for inference tensors, which have none."""
    try:
        return indices._version, offsets._version
    except RuntimeError:
        return None


def pooling_code(pooling) -> int:
    """DynamicEmbPoolingMode, or TorchRec's PoolingType / FBGEMM's PoolingMode by name."""
    name = getattr(pooling, "name", pooling)
    try:
        return int(DynamicEmbPoolingMode[str(name).upper()])
    except KeyError:
        raise ValueError(f"unknown pooling mode {pooling!r}; use SUM, MEAN or NONE") from None


def _warn_rows_left_out(module, destination, prefix, local_metadata) -> None:
    """state_dict() of the module itself (not sharded by TorchRec): its rows
    are not tensors of the state dict, so say loudly what a checkpoint of it
    would lose. (Our sharded collections' state_dict() carries them and does
    not reach this module.)"""
    warnings.warn(f"dynamicemb: state_dict() of BatchedDynamicEmbeddingTables (dynamic tables {module.table_names}, "
                  f"not sharded) holds none of their rows, optimizer state, scores or admission counters: a "
                  f"checkpoint made from it (torch.save, torch.distributed.checkpoint) loses them. Save them with "
                  f"DynamicEmbDump (and load with DynamicEmbLoad), or shard the model with dynamicemb's TorchRec "
                  f"sharders, whose state_dict() carries them", RuntimeWarning, stacklevel=3)


class _EvalOutput(torch.autograd.Function):
    """An eval-mode output with grad enabled, hooked into autograd (as a
    native table's output is): a backward through it updates no row (an
    eval forward stores nothing), which it says once, where FUSED tables
    would have trained."""

    @staticmethod
    def forward(ctx, anchor, module, lookup):
        ctx.module = module
        return lookup()  # made here, not a view of an input: the caller may modify it in place

    @staticmethod
    def backward(ctx, grad_output):
        ctx.module._note_once("eval_backward", "a backward through a forward in eval mode updates none of their "
                                               "rows (an eval forward only looks keys up; native FUSED tables "
                                               "would train here): call model.train() for a training step")
        return None, None, None


class _LookupFunction(torch.autograd.Function):
    """Forward: gather + pool. Backward: the fused optimizer update; the only
    gradient that flows to an input is that of per_sample_weights (learned
    position weights), as in FBGEMM's TBE (the anchor only hooks autograd in)."""

    @staticmethod
    def forward(ctx, anchor, module, rows, unique_keys, unique_table_ids, inverse, offsets, per_sample_weights):
        ctx.module = module
        ctx.version = module.storage.version
        ctx.step = module.step
        ctx.save_for_backward(rows, unique_keys, unique_table_ids, inverse, offsets, per_sample_weights)
        return module._gather(rows, unique_keys, inverse, offsets, per_sample_weights, training=True)

    @staticmethod
    def backward(ctx, grad_output):
        rows, unique_keys, unique_table_ids, inverse, offsets, psw = ctx.saved_tensors
        if ctx.module.storage.version != ctx.version:
            # Another training forward evicted or moved rows since this one
            # (e.g. two forwards before their backwards): update the keys'
            # current rows; a key no longer stored gets no update.
            rows = torch.where(rows >= 0, ctx.module.storage.find(unique_keys, unique_table_ids), rows)
        grad_psw = None
        if ctx.needs_input_grad[7]:  # from the rows before this update, as the TBE
            grad_psw = ctx.module._per_sample_weights_grad(grad_output, rows, unique_keys, inverse, offsets)
        ctx.module._apply_gradients(grad_output, rows, unique_table_ids, inverse, offsets, psw)
        ctx.module._closed(ctx.step)
        return (None,) * 7 + (grad_psw,)


class BatchedDynamicEmbeddingTables(nn.Module):
    """Dynamic embedding tables with a fused optimizer.

    Args:
        table_options: one DynamicEmbTableOptions per table (dim and
            max_capacity required).
        table_names: for stats and error messages.
        feature_table_map: table of each feature (default: feature i -> table i).
        pooling_mode: SUM, MEAN or NONE (one row per index; needs one dim).
        optimizer: EmbOptimType EXACT_SGD, ADAM, PARTIAL_ROWWISE_ADAM, LAMB,
            EXACT_ADAGRAD or EXACT_ROWWISE_ADAGRAD, with FBGEMM's
            hyper-parameter names and rules: the ADAM family (ADAM,
            PARTIAL_ROWWISE_ADAM, LAMB) adds weight_decay * w to its update
            (LAMB: to r), EXACT_ROWWISE_ADAGRAD
            decays per weight_decay_mode (FBGEMM's WeightDecayMode NONE, L2
            or DECOUPLE; NONE by default, as the TBE's), EXACT_SGD and
            EXACT_ADAGRAD take no weight decay.
        gradient_clipping, max_gradient: FBGEMM's; with clipping, each
            element of the output gradient is clamped to [-max_gradient,
            max_gradient] before it is summed per key (any optimizer).
        initial_accumulator_value: where the Adagrad accumulators
            (EXACT_ADAGRAD, EXACT_ROWWISE_ADAGRAD) of a new row start
            (torch.optim.Adagrad's name; 0 by default); refused for others.
        output_dtype: dtype of the output (accumulation is float32).
        seed: the initializers' seed; a key's initial row is a pure function
            of (seed, table, key).
        init_streams: per table, the id of its initializer's random stream
            (default: the table's index). Give a stable id (TorchRec's kernel
            uses a hash of the table name) when the same table may sit at
            another index elsewhere.
        storage: an EmbeddingStorage to use instead of the default
            HashTableStorage.
        feature_names: per table, the names of the features it serves (for
            checkpoints and serving; default: the table's name).
        table_poolings: per table, the pooling the user configured ("SUM",
            "MEAN" or "NONE"; default: pooling_mode), which may differ from
            pooling_mode (a row-wise sharded MEAN table pools as SUM here).
    """

    def __init__(self, table_options: Sequence[DynamicEmbTableOptions], table_names: Optional[Sequence[str]] = None,
                 feature_table_map: Optional[Sequence[int]] = None, pooling_mode=DynamicEmbPoolingMode.SUM,
                 optimizer=EmbOptimType.EXACT_SGD, learning_rate: float = 0.01, eps: float = 1.0e-8,
                 beta1: float = 0.9, beta2: float = 0.999, weight_decay: float = 0.0, weight_decay_mode=None,
                 gradient_clipping: bool = False, max_gradient: float = 1.0, initial_accumulator_value: float = 0.0,
                 output_dtype: torch.dtype = torch.float32, device=None, seed: int = 0,
                 init_streams: Optional[Sequence[int]] = None, storage: Optional[EmbeddingStorage] = None,
                 feature_names: Optional[Sequence[Sequence[str]]] = None,
                 table_poolings: Optional[Sequence[str]] = None):
        super().__init__()
        if not table_options:
            raise ValueError("BatchedDynamicEmbeddingTables needs at least one table")
        self.table_names = list(table_names) if table_names is not None else [f"t{i}" for i in range(len(table_options))]
        if len(self.table_names) != len(table_options):
            raise ValueError(f"{len(self.table_names)} table names for {len(table_options)} tables")
        for name, o in zip(self.table_names, table_options):
            o.validate(name)
        self.table_options = list(table_options)
        self.num_tables = len(table_options)
        self.dims = [o.dim for o in table_options]
        self.feature_table_map = list(feature_table_map) if feature_table_map is not None else list(range(self.num_tables))
        for f, t in enumerate(self.feature_table_map):
            if not 0 <= t < self.num_tables:
                raise ValueError(f"feature {f} maps to table {t}, outside [0, {self.num_tables})")
        self.pooling = pooling_code(pooling_mode)
        self._feature_names = [list(f) for f in feature_names] if feature_names is not None else None
        self._table_poolings = [DynamicEmbPoolingMode(pooling_code(p)).name for p in table_poolings] \
            if table_poolings is not None else None
        for what, given in (("feature_names", self._feature_names), ("table_poolings", self._table_poolings)):
            if given is not None and len(given) != self.num_tables:
                raise ValueError(f"{what} has {len(given)} entries for {self.num_tables} tables")
        # Refusals of the module's settings name its tables (a model has several modules).
        try:
            if self.pooling == DynamicEmbPoolingMode.NONE and len({self.dims[t] for t in self.feature_table_map}) > 1:
                raise ValueError(f"pooling NONE needs one dim for all tables, got {self.dims}")
            self.optimizer = optimizer_code(optimizer)
            checked_hyper_parameters(lr=learning_rate, eps=eps, beta1=beta1, beta2=beta2, weight_decay=weight_decay)
            self.weight_decay_mode = weight_decay_mode_code(weight_decay_mode)
            check_weight_decay(self.optimizer, weight_decay, self.weight_decay_mode)
            clipping_bound(bool(gradient_clipping), max_gradient)  # validated here
            state_init = state_start(self.optimizer, initial_accumulator_value)
            dtypes = {o.embedding_dtype or torch.float32 for o in table_options}
            if len(dtypes) > 1:
                raise ValueError(f"all tables of one module share a storage dtype, got {sorted(map(str, dtypes))}")
        except ValueError as e:
            raise ValueError(f"dynamicemb: tables {self.table_names}: {e}") from None
        self.learning_rate, self.eps, self.beta1, self.beta2 = learning_rate, eps, beta1, beta2
        self.weight_decay = weight_decay
        self.gradient_clipping, self.max_gradient = bool(gradient_clipping), max_gradient
        self.initial_accumulator_value = initial_accumulator_value
        self.output_dtype = output_dtype
        self.seed = seed
        self.device = canonical_device(device)
        self.embedding_dtype = dtypes.pop()
        widths = [state_width(self.optimizer, o.dim) if o.training else 0 for o in table_options]
        if self.embedding_dtype != torch.float32 and any(widths):
            warnings.warn(
                f"dynamicemb: tables {self.table_names}: {rules.optimizer(self.optimizer).name}'s state is kept in "
                f"the tables' {self.embedding_dtype} (a row holds [value | state]), where FBGEMM's TBE keeps it in "
                f"float32: in float16 an Adagrad accumulator overflows to inf past 65504 (its row then stops training) and "
                f"Adam's second moment underflows below 6e-8 (its steps grow); in bfloat16 it keeps 8 bits of "
                f"mantissa. Use float32 tables (or EXACT_SGD) where that matters", RuntimeWarning, stacklevel=2)
        self.storage = storage or make_storage(self.table_names, self.table_options, widths, self.embedding_dtype,
                                               self.device, seed, init_streams, [state_init] * self.num_tables)
        # A reopened persistent store (storage_path) resumes the counters of its last flush.
        saved = self.storage.saved_state() or {}
        self.step = int(saved.get("step", 0))  # training forwards so far (the STEP score)
        self.optimizer_step = int(saved.get("optimizer_step", 0))  # optimizer updates so far (Adam's bias correction)
        self.failed = torch.zeros(self.num_tables, dtype=torch.int64)
        # The steps of training forwards whose backward has not run (their keys are scored, their rows not yet
        # updated: incremental_dump's next threshold stays at or before them). A forward whose graph is dropped
        # without a backward leaves its step here: only the newest kOpenSteps are kept.
        self._open_steps: list = []
        # CUDA steps' counts on their way to the host, oldest first: (reporter, step, HostCopy), the
        # reporter the name of the method that counts them (keys that failed, rows not updated).
        self._counts_in_flight: list = []
        self._budget_warned = set()  # tables whose memory budget a WARNING has explained (once per table)
        self._noted = set()  # the _note_once warnings given
        self.nonfinite_grads = torch.zeros(self.num_tables, dtype=torch.int64)  # rows whose update was refused
        # The global ranks that shard these tables (set by the sharder; None: not sharded over a group).
        # Checkpoints route keys by them, so one given another group is refused.
        self.shard_ranks: Optional[Tuple[int, ...]] = None
        # Whether the collection the tables serve takes per-id weights (set by the sharder; None: not
        # known). Dumps record it, so that serving from one weighs the ids as training did.
        self.is_weighted: Optional[bool] = None
        # Per clock-scored table loaded from a checkpoint: {"loaded_at": its clock at the load, "saved_at": the
        # saving clock's latest reading (None: saved on another clock)}, for incremental_dump's thresholds.
        self.clock_loads: Dict[int, dict] = {}
        # Hooks the output into autograd so backward reaches the fused update.
        self._anchor = nn.Parameter(torch.zeros(1, device=self.device), requires_grad=True)
        # Prefetched batches whose forward may still come: (indices, offsets, their versions, emb_unique's result).
        self._prefetched: list = []
        self._register_state_dict_hook(_warn_rows_left_out)

    # ---- forward -------------------------------------------------------------------------

    def _check_input(self, indices, offsets, per_sample_weights):
        for name, t in (("indices", indices), ("offsets", offsets)):
            if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int64, torch.int32):
                raise TypeError(f"{name} must be an int64 or int32 tensor, got "
                                f"{getattr(t, 'dtype', type(t).__name__)} (features {self.feature_labels()}, "
                                f"tables {self.table_names})")
            if t.dim() != 1:
                raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
        indices = contiguous_as(indices, torch.int64)
        offsets = contiguous_as(offsets, torch.int64)
        if per_sample_weights is not None:
            if self.pooling == DynamicEmbPoolingMode.NONE:  # (refused before the step changes anything)
                raise ValueError(f"per_sample_weights are not supported with pooling NONE (one row per id, "
                                 f"nothing to weigh; tables {self.table_names})")
            if per_sample_weights.dim() != 1 or per_sample_weights.numel() != indices.numel():
                raise ValueError(f"per_sample_weights must be 1-D with one weight per index ({indices.numel()}), "
                                 f"got shape {tuple(per_sample_weights.shape)}")
            per_sample_weights = contiguous_as(per_sample_weights, torch.float32)
            check_finite_weights(per_sample_weights, offsets, self.feature_labels, "dynamicemb")  # names on error only
        return indices, offsets, per_sample_weights

    def forward(self, indices: torch.Tensor, offsets: torch.Tensor,
                per_sample_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        indices, offsets, psw = self._check_input(indices, offsets, per_sample_weights)
        if not self.training:
            if torch.is_grad_enabled():
                return _EvalOutput.apply(self._anchor, self, lambda: self._eval_lookup(indices, offsets, psw))
            return self._eval_lookup(indices, offsets, psw)
        return self._train_forward(indices, offsets, psw)

    # The training step's host-side work (dedup, insert, counters) runs
    # eagerly under torch.compile: traced, dynamo guarded on the step
    # counters and recompiled the model's graph every step. (It and the
    # decorator's wrapper are two frames between a warning and the caller.)
    @torch.compiler.disable
    def _train_forward(self, indices: torch.Tensor, offsets: torch.Tensor, psw) -> torch.Tensor:
        padded = {}
        if self._pads_unique(indices):
            ukeys, utids, inverse, counts, padded["key_count"], record = ops.emb_unique_padded(
                indices, offsets, self.feature_table_map, self.num_tables)
        else:
            ukeys, utids, inverse, counts = self._unique(indices, offsets)
        self.step += 1  # (a batch refused above is no step)
        if padded:
            self._report_counts("_check_offsets", record, self.step, stacklevel=8)
        # The keys come back in the order of their rows on the CPU: the backward then updates rows in that order.
        res = self.storage.find_or_insert(ukeys, utids, counts, self.step, inverse, **padded)
        if not torch.is_grad_enabled():  # a training-mode forward under no_grad: no backward will come
            self.storage.batch_done(newest=True)
            self._note_once("no_grad_train", "a forward in training mode under torch.no_grad() (or inference_mode) "
                                             "stores its new keys and refreshes its keys' scores as a training "
                                             "step does (new keys may evict stored ones; native tables would only "
                                             "read): call model.eval() for a forward that only looks keys up")
        else:
            self._open_steps = self._open_steps[-(self.kOpenSteps - 1):] + [self.step]
        self._report_failures(res.failed, self.step)
        rows, ukeys, utids, inverse = res.rows, res.keys, res.table_ids, res.inverse
        return _LookupFunction.apply(self._anchor, self, rows, ukeys, utids, inverse, offsets, psw)

    kOpenSteps = 8

    def _closed(self, step: int) -> None:
        """Step `step`'s backward has updated its rows."""
        if step in self._open_steps:
            self._open_steps.remove(step)

    def oldest_open_step(self) -> Optional[int]:
        """The step of the oldest training forward whose backward has not run
        (its keys scored, its rows not yet updated), or None."""
        return min(self._open_steps) if self._open_steps else None

    def _eval_lookup(self, indices, offsets, psw) -> torch.Tensor:
        """The eval forward: read-only rows, so no dedup where the storage fuses lookup and pooling."""
        out = self.storage.lookup_forward(indices, offsets, self.feature_table_map, psw, self.pooling,
                                          self.output_dtype)
        if out is not None:
            return out
        ukeys, utids, inverse, _ = self._unique(indices, offsets)
        return self._gather(self.storage.find(ukeys, utids), ukeys, inverse, offsets, psw, training=False)

    def _note_once(self, what: str, msg: str) -> None:
        """A RuntimeWarning naming the tables, once per module and `what`."""
        if what not in self._noted:
            self._noted.add(what)
            warnings.warn(f"dynamicemb: tables {self.table_names}: {msg}", RuntimeWarning, stacklevel=3)

    def _pads_unique(self, indices: torch.Tensor) -> bool:
        """Whether a training step deduplicates into outputs padded to the
        indices' length (emb_unique_padded), so that nothing in it waits for
        the device: on CUDA, where the exact unique count is a host sync,
        when the storage takes padded keys and no table raises within its
        step (ERROR mode waits for every count anyway)."""
        return indices.device.type == "cuda" and self.storage.takes_padded_keys() and not self._raises_in_step()

    def _raises_in_step(self) -> bool:
        """Whether some table is in ERROR mode: its failures and non-finite
        gradients raise within their step, so the step reads them at once."""
        return any(o.safe_check_mode == DynamicEmbCheckMode.ERROR for o in self.table_options)

    def _check_offsets(self, record: torch.Tensor, step: int, stacklevel: int) -> None:
        """emb_unique_padded's offsets check, read once its record reached the
        host: bad offsets raise emb_unique's error, naming their step (whose
        kernels read them clamped to the indices)."""
        try:
            ops.emb_offsets_verdict(record)
        except RuntimeError as e:
            raise RuntimeError(f"{e} (features {self.feature_labels()}, training step {step}, which read the "
                               f"offsets clamped to its indices)") from None

    def _gather(self, rows, ukeys, inverse, offsets, psw, training: bool) -> torch.Tensor:
        init = self._unstored_init() if training else self.storage.eval_init_params
        return ops.emb_forward(self.storage.weights(), rows, ukeys, inverse, offsets, self.feature_table_map,
                               self.dims, psw, self.pooling, init, self.seed, self.output_dtype)

    def _unstored_init(self) -> torch.Tensor:
        """The packed initializer a training read of a key with no row gets."""
        init = self.storage.unstored_init_params
        return self.storage.init_params if init is None else init

    def _report_failures(self, failed: torch.Tensor, step: int) -> None:
        """Counts keys that could not be stored; raises or warns per safe_check_mode.
        On CUDA the counts reach the host without stopping the step: a warning
        comes a step or so later (naming its step), or at table_stats(); a
        table in ERROR mode makes every step wait for them, to raise in it."""
        self._report_counts("_count_failures", failed, step, stacklevel=9)  # (the training forward's two frames)

    def _report_counts(self, reporter: str, counts: torch.Tensor, step: int, stacklevel: int) -> None:
        """Has the method named `reporter` count `counts` of `step`: at once,
        or (CUDA, no table in ERROR mode) once their copy has landed."""
        if self._defers_counts(counts):
            self._counts_in_flight.append((reporter, step, HostCopy(counts)))
            self._drain_counts(wait=False, stacklevel=stacklevel)
            return
        getattr(self, reporter)(counts.cpu(), step, stacklevel=stacklevel)

    def _defers_counts(self, counts: torch.Tensor) -> bool:
        return counts.device.type == "cuda" and not self._raises_in_step()

    def _drain_counts(self, wait: bool, stacklevel: int) -> None:
        """Reports the counts whose copies have landed (all of them with wait)."""
        while self._counts_in_flight and (wait or self._counts_in_flight[0][2].landed()):
            reporter, step, counts = self._counts_in_flight.pop(0)
            getattr(self, reporter)(counts.wait(), step, stacklevel + 1)

    def _count_failures(self, failed: torch.Tensor, step: int, stacklevel: int) -> None:
        """stacklevel: the warning's, at the module's caller."""
        if not bool(failed.any()):
            return
        self.failed += failed
        msgs, errors, budgets = [], [], []
        budget_reached = getattr(self.storage, "budget_reached", lambda t: None)
        for t in failed.nonzero().squeeze(1).tolist():
            mode = self.table_options[t].safe_check_mode
            if mode == DynamicEmbCheckMode.IGNORE:  # counted only (and no budget read: on CUDA it may wait)
                continue
            msg = (f"table {self.table_names[t]!r}: {int(failed[t])} keys could not be stored at step {step} "
                   f"(bucket full of keys held by this batch, or NO_EVICTION at its memory budget)")
            if mode == DynamicEmbCheckMode.ERROR:
                why = budget_reached(t)
                budgets.append(why is not None)
                errors.append(msg if why is None else f"{msg}: {why}")
                continue
            msg += "; they read their initial value"
            # WARNING: the budget explained once per table (and asked about until then only).
            why = None if t in self._budget_warned else budget_reached(t)
            if why is not None:
                self._budget_warned.add(t)
                msg = f"{msg}: {why}"
            msgs.append(msg)
        if errors:  # one error naming every table (the WARNING ones too: the step raises)
            msg = (f"dynamicemb: {'; '.join(errors + msgs)}; the step's other keys are stored (new keys may have "
                   f"evicted others, as in any step) and none of its rows is trained")
            # A budget error only when every ERROR table is at its budget: its handler raises budgets.
            raise DynamicEmbBudgetError(msg) if all(budgets) else RuntimeError(msg)
        if msgs:
            warn_step("dynamicemb: " + "; ".join(msgs), RuntimeWarning, stacklevel=stacklevel)

    # ---- backward ---------------------------------------------------------------------------

    def _apply_gradients(self, grad_output, rows, utids, inverse, offsets, psw) -> None:
        if not all(o.training for o in self.table_options):
            raise RuntimeError("dynamicemb: a table built with training=False has no optimizer state to update")
        grad_output = contiguous_as(grad_output, torch.float32)
        # A table in ERROR mode raises before any row is written: the step
        # looks at the gradient first (a host synchronisation on CUDA). A NaN /
        # inf anywhere makes the sum non-finite: one reduction, no mask (~30x
        # cheaper than isfinite().all()); an overflowing sum of finite values
        # only takes the exact per-row path, which then finds nothing.
        # Otherwise the update itself leaves out the rows whose summed
        # gradient is not finite, and counts them per table on the device;
        # it does under ERROR too, where a sum of finite entries that
        # overflows (only the summing finds it) raises after the update.
        check_first = self._raises_in_step()
        if check_first and not bool(torch.isfinite(grad_output.sum())):
            rows = self._skip_nonfinite(grad_output, rows, utids, inverse, offsets)
        self.optimizer_step += 1
        skipped = ops.emb_backward_update(grad_output, self.storage.weights(), rows, utids,
                                          inverse, offsets, self.feature_table_map, self.dims, psw, self.pooling,
                                          self.optimizer, self.learning_rate, self.eps, self.beta1, self.beta2,
                                          self.weight_decay, self.optimizer_step, self.weight_decay_mode,
                                          clipping_bound(self.gradient_clipping, self.max_gradient),
                                          skip_nonfinite=True)
        self.storage.batch_done()  # its rows may move again
        if not check_first:  # on CUDA counted when the copy lands: the step does not wait
            self._report_counts("_count_nonfinite", skipped, self.optimizer_step, stacklevel=5)
        else:
            self._overflowed(skipped.cpu(), self.optimizer_step)

    def _overflowed(self, counts: torch.Tensor, optimizer_step: int) -> None:
        """Under ERROR, rows the update left out although no gradient entry
        was NaN / inf (checked first): their summed gradient overflowed.
        Counted and warned as any; an ERROR table's raise, its other rows
        updated."""
        self._count_nonfinite(counts, optimizer_step, stacklevel=6)
        errors = [self._nonfinite_msg(t, counts, optimizer_step) for t in counts.nonzero().squeeze(1).tolist()
                  if self.table_options[t].safe_check_mode == DynamicEmbCheckMode.ERROR]
        if errors:
            raise FloatingPointError("dynamicemb: " + "; ".join(errors) + " (a sum of finite entries that "
                                     "overflowed); those rows were left out of the update, the others updated")

    def _count_nonfinite(self, counts: torch.Tensor, optimizer_step: int, stacklevel: int) -> None:
        """Rows per table whose update was left out for a non-finite gradient
        (WARNING and IGNORE modes): counted, and warned once per step."""
        if not bool(counts.any()):
            return
        self.nonfinite_grads += counts
        msgs = [self._nonfinite_msg(t, counts, optimizer_step) for t in counts.nonzero().squeeze(1).tolist()
                if self.table_options[t].safe_check_mode == DynamicEmbCheckMode.WARNING]
        if msgs:
            warn_step("dynamicemb: " + "; ".join(msgs) + "; their updates were skipped", RuntimeWarning,
                      stacklevel=stacklevel)

    def _skip_nonfinite(self, grad_output, rows, utids, inverse, offsets) -> torch.Tensor:
        """Rows whose summed gradient would hold a NaN / inf: counted per
        table (nonfinite_grads); under ERROR the step raises before any row
        is written, else the rows are left out of the update (row -1)."""
        bad = ~torch.isfinite(grad_output)
        if self.pooling == DynamicEmbPoolingMode.NONE:  # one output row per index
            bad_index = bad.any(1)
        else:  # [B, sum of the features' dims]: a bag's feature slice feeds each of its indices
            F = len(self.feature_table_map)
            B = (offsets.numel() - 1) // F
            cols = torch.tensor([self.dims[t] for t in self.feature_table_map], device=bad.device)
            feature_of_col = torch.repeat_interleave(torch.arange(F, device=bad.device), cols)
            per_bag = torch.zeros(B, F, dtype=torch.int32, device=bad.device).index_add_(
                1, feature_of_col, bad.to(torch.int32))
            bag_of_index = torch.repeat_interleave(torch.arange(F * B, device=bad.device), offsets.diff(),
                                                   output_size=inverse.numel())
            bad_index = (per_bag.t().reshape(-1) > 0)[bag_of_index]
        bad_u = torch.zeros(rows.numel(), dtype=torch.bool, device=rows.device)
        bad_u[inverse[bad_index]] = True
        bad_u &= rows >= 0
        counts = torch.bincount(utids[bad_u], minlength=self.num_tables).cpu()
        step = self.optimizer_step + 1
        for t in counts.nonzero().squeeze(1).tolist():
            if self.table_options[t].safe_check_mode == DynamicEmbCheckMode.ERROR:
                self.nonfinite_grads += counts
                self.storage.batch_done()
                raise FloatingPointError(f"dynamicemb: {self._nonfinite_msg(t, counts, step)}; no row was updated")
        self._count_nonfinite(counts, step, stacklevel=5)
        return torch.where(bad_u, torch.full_like(rows, -1), rows)

    def _nonfinite_msg(self, t: int, counts: torch.Tensor, optimizer_step: int) -> str:
        return (f"table {self.table_names[t]!r}: {int(counts[t])} rows got a non-finite (NaN / inf) gradient at "
                f"optimizer step {optimizer_step}")

    def _per_sample_weights_grad(self, grad_output, rows, ukeys, inverse, offsets) -> torch.Tensor:
        """d loss / d per_sample_weights[i]: the row of index i (stored or
        initial) dotted with the output gradient of its bag (/ length for MEAN)."""
        F = len(self.feature_table_map)
        B = (offsets.numel() - 1) // F
        grad_output = grad_output.to(torch.float32)
        lengths = offsets.diff()
        grad = torch.zeros(inverse.numel(), dtype=torch.float32, device=inverse.device)
        col = 0
        for f, t in enumerate(self.feature_table_map):
            lo, hi, D = int(offsets[f * B]), int(offsets[(f + 1) * B]), self.dims[t]
            if hi > lo:
                # One bag per index: the kernel returns each index's own row.
                one = torch.arange(hi - lo + 1, dtype=torch.int64, device=offsets.device)
                vals = ops.emb_forward(self.storage.weights(), rows, ukeys, inverse[lo:hi].contiguous(), one, [t],
                                       self.dims, None, int(DynamicEmbPoolingMode.SUM), self._unstored_init(),
                                       self.seed, torch.float32)
                lens = lengths[f * B:(f + 1) * B]
                bag = torch.repeat_interleave(torch.arange(B, device=offsets.device), lens)
                dot = (vals * grad_output[bag, col:col + D]).sum(1)
                grad[lo:hi] = dot / lens[bag] if self.pooling == DynamicEmbPoolingMode.MEAN else dot
            col += D
        return grad

    def feature_labels(self) -> list:
        """The name of each input feature (TBE order): its table's k-th
        feature name for the table's k-th feature, else the table's name."""
        seen = [0] * self.num_tables
        labels = []
        for t in self.feature_table_map:
            names = self.feature_names_of(t)
            labels.append(names[seen[t]] if seen[t] < len(names) else self.table_names[t])
            seen[t] += 1
        return labels

    def feature_names_of(self, t: int) -> list:
        """The features table t serves (its name when none were given)."""
        return list(self._feature_names[t]) if self._feature_names is not None else [self.table_names[t]]

    def table_pooling_name(self, t: int) -> str:
        """Table t's pooling as configured: "SUM", "MEAN" or "NONE"."""
        if self._table_poolings is not None:
            return self._table_poolings[t]
        return DynamicEmbPoolingMode(self.pooling).name

    # ---- tiers ----------------------------------------------------------------------------------

    def prefetch(self, indices: torch.Tensor, offsets: torch.Tensor, forward_stream=None,
                 batch_size_per_feature_per_rank=None) -> None:
        """Readies the rows of a coming batch (TorchRec's prefetch pipelines
        call this one batch ahead): a cached table places every key of the
        batch in its cache (the stored rows taken from its backing store,
        new keys with their initial rows) and pins them there until that
        batch's forward, which then moves nothing. The new keys stay
        provisional until that forward stores them: no lookup, counter,
        export or flush sees them, and a prefetch whose forward never comes
        stores nothing (the rows it wrote back to make room stay in the
        store, which evicts as a forward's write-backs would). In eval mode
        it does nothing: an eval forward reads both tiers and moves nothing
        (a prefetch pipeline run under model.eval() emptied the cache into a
        store that then evicted trained rows)."""
        indices, offsets, _ = self._check_input(indices, offsets, None)
        if not self.training:
            return
        side = forward_stream is not None and indices.device.type == "cuda"
        if side:
            # A prefetch on another stream (TorchRec's pipelines) changes the
            # cache only after the work already queued on the forward stream
            # (a batch's lookups and optimizer updates of the same tables)...
            current = torch.cuda.current_stream(indices.device)
            current.wait_stream(forward_stream)
        unique = ops.emb_unique(indices, offsets, self.feature_table_map, self.num_tables)
        self.storage.prefetch(unique[0], unique[1])
        if side:  # ... and the next forward reads the rows it placed
            forward_stream.wait_stream(current)
        # On the CPU, the batch's forward reuses this deduplication (_unique).
        # (Not on a GPU: there the prefetch runs on another stream, and comparing batches would sync.)
        versions = _versions(indices, offsets) if indices.device.type == "cpu" else None
        if versions is not None:
            self._prefetched.append((indices, offsets, versions, unique))
            del self._prefetched[:-PENDING_PREFETCHES]  # their deduplication is kept for their forward

    def _unique(self, indices: torch.Tensor, offsets: torch.Tensor):
        """emb_unique of the batch, or that of its prefetch when the batch
        was prefetched: the same indices and offsets, neither changed in
        place since (their version counters), so the same result."""
        for i, (p_indices, p_offsets, versions, unique) in enumerate(self._prefetched):
            if (p_indices.shape == indices.shape and p_offsets.shape == offsets.shape
                    and _versions(p_indices, p_offsets) == versions
                    and (p_indices is indices or torch.equal(p_indices, indices))
                    and (p_offsets is offsets or torch.equal(p_offsets, offsets))):
                del self._prefetched[:i + 1]  # used once; those prefetched before it are not coming
                return unique
        return ops.emb_unique(indices, offsets, self.feature_table_map, self.num_tables)

    def flush(self) -> None:
        """Writes every cached row back to its backing store (between steps);
        a persistent one (storage_path) also keeps this module's step
        counters, which a module reopening it resumes from."""
        self.storage.flush({"step": self.step, "optimizer_step": self.optimizer_step})

    def close(self, flush: bool = True) -> None:
        """Done with the module's tiers: writes every cached row back first
        (`flush`), then releases a backing store the module opened itself
        (storage_path: its files and locks, so that another module or
        process may open them). A `backing_store` you passed stays open:
        close it yourself."""
        if flush:
            self.flush()
        self.storage.close()

    # ---- accounting ----------------------------------------------------------------------------

    # FBGEMM's TBE hyper-parameter calls, read by the next backward's update
    # (TorchRec's fused optimizer, dynamicemb.shard.fused_optimizer, calls them).
    def set_learning_rate(self, lr: float) -> None:
        try:
            self.learning_rate = checked_hyper_parameters(lr=lr)["lr"]
        except ValueError as e:
            raise ValueError(f"dynamicemb: tables {self.table_names}: {e}") from None

    def get_learning_rate(self) -> float:
        return self.learning_rate

    def update_hyper_parameters(self, params: Dict[str, float]) -> None:
        """FBGEMM's names: lr, eps, beta1, beta2, weight_decay. All are
        checked before any changes; a bad one raises, naming the tables."""
        try:
            updates = hyper_parameter_updates(self.optimizer, self.weight_decay_mode, params)
        except ValueError as e:
            raise ValueError(f"dynamicemb: tables {self.table_names}: {e}") from None
        for attr, value in updates.items():
            setattr(self, attr, value)

    def set_optimizer_step(self, step: int) -> None:
        """The optimizer updates so far: the next backward's is step + 1
        (Adam's bias correction), as FBGEMM's set_optimizer_step."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"dynamicemb: tables {self.table_names}: set_optimizer_step takes an int >= 0, "
                             f"got {step!r}")
        self.optimizer_step = step

    def set_score(self, score: int, table_id: Optional[int] = None) -> None:
        """The CUSTOMIZED score given to keys accessed from now on."""
        score = int64_score(score, f"tables {self.table_names}: set_score")
        for t in range(self.num_tables) if table_id is None else [table_id]:
            self.storage.custom_scores[t] = score

    def table_stats(self) -> dict:
        """{table_name: {size, capacity, inserted, evicted, failed, admission_rejected, nonfinite_grads}}."""
        self._drain_counts(wait=True, stacklevel=3)  # the warnings of CUDA steps not yet counted
        return {n: dict(self.storage.stats(t), nonfinite_grads=int(self.nonfinite_grads[t]))
                for t, n in enumerate(self.table_names)}


class BatchedDynamicEmbeddingTablesV2(BatchedDynamicEmbeddingTables):
    """NVIDIA dynamicemb's name of this module (deprecated): the same module,
    with a DeprecationWarning that names ours."""

    def __init__(self, *args, **kwargs):
        renamed("BatchedDynamicEmbeddingTablesV2", "BatchedDynamicEmbeddingTables")
        super().__init__(*args, **kwargs)
