"""BERT sequence classification (transformers' BertForSequenceClassification): the encoder
layer, the embeddings with token types, the pooler (its dense layer sliced on both sides with
the hidden channels) and the classifier, a new head trained in full."""

from __future__ import annotations

from apt_ds.models.encoder_layer import ENCODER_FIELDS, embedding_tensors
from apt_ds.models.family import Family, LeftOut, OuterTensor

BERT = Family(
    model_type="bert",
    names="BERT",
    config_class="BertConfig",
    causal_lm_class="BertForSequenceClassification",
    embedding="bert.embeddings.word_embeddings.weight",
    layers="bert.encoder.layer",
    outer=embedding_tensors("bert") + (
        OuterTensor("bert.pooler.dense.weight", ("hidden", "hidden"), "head"),
        OuterTensor("bert.pooler.dense.bias", ("hidden",), "head"),
        OuterTensor("classifier.weight", ("labels", "hidden"), "head"),
        OuterTensor("classifier.bias", ("labels",), "head"),
    ),
    head_input="classifier",
    left_out=(LeftOut(r"(bert\.)?embeddings\.position_ids", "an index buffer older transformers saved; rebuilt at load"),
              LeftOut(r"cls\..*", "BERT's pretraining heads (masked LM, next sentence), which a classifier does not use")),
    **ENCODER_FIELDS,
)
