"""How wide the int8 graph's quantization blocks are (``workers.tuning.block_choice``): the widest
whose measured perplexity keeps the 2% rule, blocks of 32 where none does."""

from pathlib import Path

from workers.tuning import block_choice
from workers.tuning.perplexity import Rise


def choose(rises: dict[int, float | Exception]):
    """``choose`` over fake graphs whose measured rise (in percent) is ``rises[block]``."""
    built: list[int] = []

    def build(block: int) -> Path:
        built.append(block)
        return Path(f"graph-{block}")

    def measure(block: int, graph: Path) -> Rise:
        assert graph == Path(f"graph-{block}")
        rise = rises[block]
        if isinstance(rise, Exception):
            raise rise
        return Rise(reference=10.0, graph=10.0 * (1 + rise / 100), tokens=2044)

    return block_choice.choose(build, measure), built


def test_the_widest_blocks_within_the_rule_serve_and_narrower_ones_are_not_built():
    choice, built = choose({128: 1.5, 64: 0.6})
    assert (choice.block, choice.graph, built) == (128, Path("graph-128"), [128])
    assert round(choice.rise.percent, 6) == 1.5 and choice.refused == ()
    assert choice.summary().startswith("blocks of 128, perplexity 10.15 against 10.00 in float32 (+1.5%")


def test_blocks_that_cost_more_than_the_rule_give_way_to_narrower_ones_and_say_why():
    choice, built = choose({128: 2.5, 64: 0.7})
    assert (choice.block, built) == (64, [128, 64])
    assert choice.refused == ((128, "perplexity +2.5% over float32, past 2%"),)
    assert "blocks of 128 refused: perplexity +2.5%" in choice.summary()


def test_where_no_wide_blocks_keep_the_rule_blocks_of_32_serve_unmeasured():
    choice, built = choose({128: 9.0, 64: 3.0})
    assert (choice.block, choice.rise, built) == (32, None, [128, 64, 32])
    assert [block for block, _ in choice.refused] == [128, 64]


def test_a_measurement_that_breaks_passes_the_blocks_over_with_the_reason():
    choice, built = choose({128: RuntimeError("the measuring process died"), 64: 0.7})
    assert choice.block == 64
    assert choice.refused == ((128, "not measured, the measuring process died"),)
