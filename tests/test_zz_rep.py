import pytest, torch
from test_distill import test_a_merged_pool_pass_distils_as_the_separate_one as body

@pytest.mark.parametrize("i", range(30))
def test_rep(corpora, tmp_path, i):
    torch.manual_seed(1000 + i)
    body(corpora, tmp_path)
