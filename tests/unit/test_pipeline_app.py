"""pipeline_lm's data and loss without processes: a schedule cuts the target where it cuts the
tokens, whatever the micro-batch count."""
import torch

from commrt.apps.pipeline_model import batch, loss, make_model


def test_micro_batches_of_tokens_and_targets_line_up_when_they_do_not_divide_the_rows():
    """The target was flattened to [rows * seq]: with 32 rows in 3 micro-batches the tokens were
    cut 11/11/10 rows and the targets 171/171/170 tokens, and the last stage failed with
    'Expected input batch_size (176) to match target batch_size (171)'."""
    model = make_model(vocab=16, dim=8, blocks=1)
    x, y = batch(0, rows=32, seq=4, vocab=16)
    whole = loss(model(x), y)
    parts = [(loss(model(xm), ym), ym.shape[0]) for xm, ym in zip(torch.tensor_split(x, 3), torch.tensor_split(y, 3))]
    assert torch.allclose(sum(l * n / 32 for l, n in parts), whole)  # the runtime's share-weighted sum
