"""ART's `art.utils` at our path: `iterate_dataset` (with `DatasetBatch`) and `retry`.

`from art.utils import iterate_dataset` ports as `from art_core.utils import iterate_dataset`.
"""

from art_core.rollouts.dataset import DatasetBatch, iterate_dataset
from art_core.rollouts.retry import retry

__all__ = ["DatasetBatch", "iterate_dataset", "retry"]
