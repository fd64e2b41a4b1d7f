"""Documents from a Hugging Face hub dataset, streamed (`datasets`, imported lazily).

Training reads the dataset's `train` split, validation its `validation` split (as
torchtitan's `c4_validation` does), so that validation on a hub dataset is held out.
A dataset of several configs takes one after a colon, `NAME:CONFIG`
(`allenai/c4:en`, `HuggingFaceFW/fineweb-edu:sample-10BT`): hub names hold no colon, and one
string per source keeps a mixture's `path` and `titan tokenize`'s inputs as they are.
"""

from __future__ import annotations

from collections.abc import Iterator

from titan_core.config.errors import ConfigError, MissingPackageError

__all__ = ["HFDatasetSource"]


class HFDatasetSource:
    """The `train` split of a hub dataset, streamed, one document per record.

    Args:
        name: the dataset's hub name, e.g. `"allenai/c4"`, with its config after a colon where it has several
            (`"allenai/c4:en"`).
        text_field: the record field that holds the text.
        key: the setting that names the dataset (a config key or a command's argument), for error messages.
        field_key: the setting that holds `text_field`, named when a record lacks the field.
        split: the dataset's split to read: `"train"`, or `"validation"` for a validation section.
    """

    def __init__(
        self,
        name: str,
        text_field: str = "text",
        *,
        key: str = "training.dataset",
        field_key: str = "training.dataset_text_field",
        split: str = "train",
    ):
        try:
            import datasets
        except ImportError as e:
            raise MissingPackageError(
                f"{key}: streaming {name!r} from the hub needs the datasets package: "
                f"pip install 'titan-core[hf]', or point {key} at 'stdlib' or local files"
            ) from e
        self.name = name
        self.text_field = text_field
        self.key = key
        self.field_key = field_key
        self.split = split
        repo, colon, config = name.partition(":")
        try:
            self._dataset = datasets.load_dataset(repo, name=config or None, split=split, streaming=True)
        except Exception as e:
            reason = " ".join(str(e).split())[:300]  # datasets lists the configs on the lines after the first
            if not colon and "config" in reason.lower():
                fix = f"name one after a colon ({repo}:CONFIG)"
            else:
                fix = f"point {key} at local .txt/.jsonl/.parquet files (a file, folder or glob), or 'stdlib'"
            raise ConfigError(
                f"{key}: could not load the {split!r} split of {name!r} from the Hugging Face hub "
                f"(hub unreachable, offline, no such dataset, config or split: {type(e).__name__}: {reason}); {fix}"
            ) from e

    def __iter__(self) -> Iterator[str]:
        return self.skip(0)

    def skip(self, n_docs: int) -> Iterator[str]:
        """The records' texts from the `n_docs`-th record on.

        Args:
            n_docs: how many records to skip (the stream skips them unparsed).
        """
        dataset = self._dataset.skip(n_docs) if n_docs > 0 else self._dataset
        for record in dataset:
            if self.text_field not in record:
                raise ConfigError(
                    f"{self.key}: {self.name!r} records have no field {self.text_field!r} "
                    f"(have {list(record)}); set {self.field_key} to the field of the text"
                )
            yield str(record[self.text_field] or "")

    def __repr__(self) -> str:
        return f"HFDatasetSource({self.name!r}, text_field={self.text_field!r}, split={self.split!r})"
