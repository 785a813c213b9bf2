"""RoBERTa sequence classification (transformers' RobertaForSequenceClassification): BERT's
layer and embeddings (its position ids start after the padding index) and a two-Linear head
with no pooler, trained in full."""

from __future__ import annotations

from apt_ds.models.encoder_layer import ENCODER_FIELDS, embedding_tensors
from apt_ds.models.family import Family, LeftOut, OuterTensor

ROBERTA = Family(
    model_type="roberta",
    names="RoBERTa",
    config_class="RobertaConfig",
    causal_lm_class="RobertaForSequenceClassification",
    embedding="roberta.embeddings.word_embeddings.weight",
    layers="roberta.encoder.layer",
    outer=embedding_tensors("roberta", positions_last=True) + (
        OuterTensor("classifier.dense.weight", ("hidden", "hidden"), "head"),
        OuterTensor("classifier.dense.bias", ("hidden",), "head"),
        OuterTensor("classifier.out_proj.weight", ("labels", "hidden"), "head"),
        OuterTensor("classifier.out_proj.bias", ("labels",), "head"),
    ),
    head_input="classifier.out_proj",
    positions_after_padding=True,  # transformers' create_position_ids_from_input_ids
    left_out=(LeftOut(r"(roberta\.)?embeddings\.position_ids", "an index buffer older transformers saved; rebuilt at load"),
              LeftOut(r"(roberta\.)?pooler\..*", "RoBERTa's pooler, which its sequence classifier does not have"),
              LeftOut(r"lm_head\..*", "the masked-LM head of pretraining, which a classifier does not use")),
    **ENCODER_FIELDS,
)
