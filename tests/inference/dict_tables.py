"""An independent model of frozen tables: {key: row} dicts pooled in float64."""
from typing import Dict, List, Optional

import torch


class DictTables:
    def __init__(self, tables: Dict[str, tuple]):
        """tables: {name: (keys [n], values [n, dim])}."""
        self.rows = {n: {int(k): v.to(torch.float64) for k, v in zip(keys, values)}
                     for n, (keys, values) in tables.items()}
        self.dims = {n: int(values.shape[1]) for n, (_, values) in tables.items()}

    def row(self, table: str, key: int) -> torch.Tensor:
        return self.rows[table].get(int(key), torch.zeros(self.dims[table], dtype=torch.float64))

    def pooled(self, feature_tables: List[str], values, offsets, pooling: str = "SUM",
               weights: Optional[torch.Tensor] = None, mean_divisor: str = "length") -> torch.Tensor:
        """[B, sum dims] for TBE-layout input (offsets [F * B + 1])."""
        F = len(feature_tables)
        B = (offsets.numel() - 1) // F
        out = []
        for b in range(B):
            cols = []
            for f, t in enumerate(feature_tables):
                lo, hi = int(offsets[f * B + b]), int(offsets[f * B + b + 1])
                acc = torch.zeros(self.dims[t], dtype=torch.float64)
                for i in range(lo, hi):
                    acc += (1.0 if weights is None else float(weights[i])) * self.row(t, values[i])
                if pooling == "MEAN":
                    if mean_divisor == "length":
                        acc = acc / max(1, hi - lo)
                    else:
                        acc = acc / ((hi - lo if weights is None else float(weights[lo:hi].sum())) + 1e-6)
                cols.append(acc)
            out.append(torch.cat(cols))
        return torch.stack(out) if out else torch.zeros(0, sum(self.dims[t] for t in feature_tables), dtype=torch.float64)

    def sequence(self, table_of_id: List[str], values) -> torch.Tensor:
        """[ids, dim]: each id's row."""
        return torch.stack([self.row(t, k) for t, k in zip(table_of_id, values)])
