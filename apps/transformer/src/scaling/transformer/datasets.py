"""The datasets a transformer config's ``data`` section describes: token files, a blend, or prompt/completion JSONL.

Above both ``data`` (token datasets, the batch) and ``jsonl`` (prompt/completion examples, which
build ``data``'s batches), so neither imports the other's caller.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from scaling.data import BaseDataset, BlendedDataset
from scaling.transformer.corpus import default_paths
from scaling.transformer.data import TransformerDataset, open_tokens, tokenizer_path
from scaling.transformer.jsonl import PromptCompletionDataset

if TYPE_CHECKING:
    from scaling.transformer.config import TransformerConfig


# Any: the datasets' item and batch types differ by source (LM packing, prompt/completion, blends of them).
def build_datasets(config: TransformerConfig) -> tuple[BaseDataset[Any, Any], BaseDataset[Any, Any] | None]:
    """The training and (optional) evaluation datasets the ``data`` section describes.

    ``data.finetuning_jsonl``: prompt/completion examples; ``data.blend``: token datasets mixed by
    weight (``trainer.train_iterations * topology.global_batch_size`` samples); ``data.data_prefix``:
    one token dataset; none of them: the default corpus built by ``preprocess``.
    """
    data, vocab, seq = config.data, config.transformer_architecture.vocab_size, config.data.sequence_length
    if data.finetuning_jsonl is not None:
        from tokenizers import Tokenizer

        path = tokenizer_path(config)
        if not path.is_file():
            raise FileNotFoundError(
                f"data.tokenizer_path={str(path)!r} does not exist; data.finetuning_jsonl needs the tokenizer "
                "(set data.tokenizer_path or run `scaling-transformer preprocess`)"
            )
        tokenizer = Tokenizer.from_file(str(path))
        evaluation = data.finetuning_jsonl_evaluation
        return PromptCompletionDataset(data.finetuning_jsonl, tokenizer, seq, vocab), (
            None if evaluation is None else PromptCompletionDataset(evaluation, tokenizer, seq, vocab)
        )
    eval_prefix = data.evaluation_prefix
    if data.blend:
        sources = [
            TransformerDataset(open_tokens(s.prefix, vocab, f"data.blend[{i}].prefix"), seq)
            for i, s in enumerate(data.blend)
        ]
        batch = config.topology.global_batch_size
        assert batch is not None  # TopologyConfig derives every size it was not given
        num_samples = config.trainer.train_iterations * batch
        dataset: BaseDataset[Any, Any] = BlendedDataset(  # Any: as above
            sources, [s.weight for s in data.blend], num_samples, seed=config.trainer.seed
        )
    else:
        train_prefix = data.data_prefix
        if train_prefix is None:
            paths = default_paths(data.default_corpus_dir)
            train_prefix = paths["train"]
            eval_prefix = eval_prefix or paths["validation"]
        dataset = TransformerDataset(open_tokens(train_prefix, vocab, "data.data_prefix"), seq)
    dataset_evaluation = None
    if eval_prefix is not None:
        dataset_evaluation = TransformerDataset(open_tokens(eval_prefix, vocab, "data.evaluation_prefix"), seq)
    return dataset, dataset_evaluation
