"""Child process of test_mapped.py: serves a saved InferenceEmbeddingTable
from its memory map and reports its anonymous memory (RssAnon).

    python serve_mapped.py TABLE REQUESTS OUT

REQUESTS: torch.save'd list of (values, offsets) batches; OUT: the outputs'
raw bytes, batch after batch (written as they come, so that they are not
held in this process). Prints one JSON line: RssAnon / RssFile in bytes
before the load (after imports and reading the requests) and the most seen
after any batch."""
import json
import sys

import torch

from dynamicemb.inference import InferenceEmbeddingTable


def rss() -> dict:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("RssAnon:", "RssFile:")):
                k, v, _ = line.split()
                out[k[:-1]] = int(v) * 1024
    return out


def main(table: str, requests: str, out_path: str) -> None:
    batches = torch.load(requests)
    before = rss()
    module = InferenceEmbeddingTable.load(table, mmap=True)
    loaded = rss()
    most = dict(loaded)
    with open(out_path, "wb") as f:
        for values, offsets in batches:
            out = module(values, offsets)
            f.write(memoryview(out.contiguous().view(torch.uint8).numpy()).cast("B"))
            del out
            most = {k: max(most[k], v) for k, v in rss().items()}
    print(json.dumps({"before": before, "loaded": loaded, "most": most}))


if __name__ == "__main__":
    main(*sys.argv[1:4])
