"""TorchRec's PrefetchTrainPipelineSparseDist, runnable on CPU.

The pipeline prefetches batch i+1 (its rows move from a cached table's
backing store into the cache) between the forward and the backward of batch
i. TorchRec 1.8's prefetch stage (train_pipeline.utils.prefetch_embeddings)
returns at once when the pipeline has no data-dist stream, which is the case
on CPU; the forward then finds no prefetched input and fails ("Invalid
PrefetchPipelinedForward usage"). On CPU this class runs the same stage
without streams: wait for the batch's input distribution, call each sharded
module's prefetch(), keep its input and context for the forward. On CUDA it
is TorchRec's pipeline unchanged.
"""
from typing import cast

from torchrec.distributed.train_pipeline import PrefetchTrainPipelineSparseDist as _TorchRecPrefetchPipeline
from torchrec.distributed.train_pipeline.pipeline_context import PrefetchTrainPipelineContext


class PrefetchTrainPipelineSparseDist(_TorchRecPrefetchPipeline):
    """Drop-in for torchrec's PrefetchTrainPipelineSparseDist (same
    arguments) that also runs on CPU."""

    def _prefetch(self, context: PrefetchTrainPipelineContext) -> None:
        if self._data_dist_stream is not None:  # CUDA / MTIA: TorchRec's own stage
            return super()._prefetch(context)
        context.module_input_post_prefetch.clear()
        context.module_contexts_post_prefetch.clear()
        for module in self._pipelined_modules:
            name = cast(str, module.forward._name)
            dist_input = context.input_dist_tensors_requests.pop(name).wait()
            module_context = context.module_contexts.pop(name)
            module.prefetch(ctx=module_context, dist_input=dist_input, forward_stream=None)
            context.module_input_post_prefetch[name] = dist_input
            context.module_contexts_post_prefetch[name] = module_context
