import scaling.transformer as st

EXPECTED = {
    "EmbeddingLayer", "LMHeadLayer", "TransformerArchitectureConfig", "TransformerBatch", "TransformerBlock",
    "TransformerConfig", "TransformerDataset", "TransformerHeadOutput", "TransformerLM", "TransformerLayerIO",
    "TransformerLoss", "export_hf", "generate", "import_hf", "layer_specs", "load_model", "sample_next",
    "BlendSourceConfig", "FinetuningConfig", "TrainingGroupConfig", "PromptCompletionDataset", "apply_finetuning",
    "build_datasets", "export_peft", "training_groups",
}  # fmt: skip


def test_public_api_is_pinned():
    assert set(st.__all__) == EXPECTED
    assert all(hasattr(st, name) for name in EXPECTED)
