"""The bench harness's arithmetic and rendering (bench/benchkit.py): nothing here times anything."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).resolve().parent.parent / "bench"))  # after tests/: its modules never shadow ours
from benchkit import BEGIN, END, Figure, percentile, render_table, replace_between_markers


def test_percentile_is_nearest_rank() -> None:
    values = list(range(1, 101))  # 1..100, shuffled order must not matter
    values.reverse()
    assert percentile(values, 50) == 50
    assert percentile(values, 99) == 99
    assert percentile(values, 99.9) == 100
    assert percentile(values, 100) == 100
    assert percentile(values, 0) == 1


def test_percentile_never_invents_a_value() -> None:
    samples = [1.0, 2.0, 1000.0]
    assert percentile(samples, 50) == 2.0
    assert percentile(samples, 99) == 1000.0  # one slow request in three is the p99
    assert all(percentile(samples, q) in samples for q in (1, 33, 34, 66, 67, 99.9))


def test_percentile_of_nothing_is_an_error() -> None:
    with pytest.raises(ValueError):
        percentile([], 50)


def test_table_shows_value_goal_result_and_baselines() -> None:
    rows = render_table([
        Figure(1, "spawn → READY=1", 412.345, "ms", "≤ 500 ms", True, {"python3 -c pass": "51 ms"}),
        Figure(3, "idle CPU", 0.82, "% of a core", "≤ 0.1 %", False),
        Figure(9, "CDI spec", None, "ms", "—", None),
    ]).splitlines()
    assert rows[0].startswith("| # | figure | measured | goal | result |")
    assert rows[2] == "| 1 | spawn → READY=1 | 412 ms | ≤ 500 ms | pass | python3 -c pass 51 ms |"
    assert rows[3] == "| 3 | idle CPU | 0.82 % of a core | ≤ 0.1 % | **miss** | — |"
    assert rows[4] == "| 9 | CDI spec | n/a | — | n/a | — |"


def test_readme_block_is_replaced_between_markers_only() -> None:
    text = f"# T\n\nbefore\n{BEGIN}\nold table\n{END}\nafter\n"
    assert replace_between_markers(text, "new\n") == f"# T\n\nbefore\n{BEGIN}\nnew\n{END}\nafter\n"


@pytest.mark.parametrize("text", ["no markers", f"{END}\n{BEGIN}\n", f"{BEGIN}{END}{BEGIN}{END}"])
def test_readme_without_one_pair_of_markers_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="bench:begin"):
        replace_between_markers(text, "x")


def test_load_generator_reads_content_length_and_chunked_responses() -> None:
    from loadgen import parse_response

    sized = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    assert parse_response(sized + b"HTTP/1.1 503") == (200, len(sized))
    assert parse_response(sized[:-1]) is None  # body not all there yet
    chunked = (b"HTTP/1.1 503 Service Unavailable\r\nTransfer-Encoding: chunked\r\n\r\n"
               b"3\r\nabc\r\n2;x=1\r\nde\r\n0\r\n\r\n")
    assert parse_response(chunked) == (503, len(chunked))
    assert parse_response(chunked[:-2]) is None
    assert parse_response(b"HTTP/1.1 204 No Content\r\n") is None


def test_importtime_report_sums_own_times_and_ranks_top_level_imports() -> None:
    from benchkit import parse_importtime

    report = "\n".join([
        "import time: self [us] | cumulative | imported package",
        "import time:       100 |        100 |     _io",
        "import time:      2000 |       2100 | encodings",
        "import time:       500 |        500 |     pydantic_core",
        "import time:     30000 |      30500 |   pydantic",
        "import time:      1000 |      31500 | gpu_agent.config",
        "some other stderr line",
    ])
    parsed = parse_importtime(report)
    assert parsed["imports_ms"] == 33.6
    assert parsed["largest"] == ["gpu_agent.config 32 ms", "encodings 2 ms"]


class _ClosingServer:
    """Answers the first `answered` requests of each connection, then closes it at the next one without
    an answer, as a server closing an idle keep-alive connection just as a request arrives."""

    def __init__(self, answered: int) -> None:
        self.answered = answered

    def protocol(self) -> object:
        import asyncio

        server = self

        class Closing(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                self.transport, self.seen = transport, 0

            def data_received(self, data: bytes) -> None:
                self.seen += data.count(b"\r\n\r\n")
                if self.seen > server.answered:
                    self.transport.abort()
                else:
                    self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")

        return Closing()


def _load_against(answered: int) -> dict:
    import asyncio

    from loadgen import run_load

    async def run() -> dict:
        server = await asyncio.get_running_loop().create_server(_ClosingServer(answered).protocol, "127.0.0.1", 0)
        async with server:
            port = server.sockets[0].getsockname()[1]
            return await run_load("127.0.0.1", port, "/", 200.0, 0.25, 4, False)

    return asyncio.run(run())


def test_load_generator_sends_again_a_request_lost_to_a_keep_alive_close_and_counts_it() -> None:
    result = _load_against(answered=1)  # every connection's second request is lost
    assert result["errors"] == 0 and result["completed"] == result["scheduled"] == 50
    assert result["retried_after_idle_close"] >= 1


def test_load_generator_counts_a_connection_closed_before_any_answer_as_an_error() -> None:
    result = _load_against(answered=0)  # never answers: nothing to send again
    assert result["error_kinds"]["closed_before_answer"] == result["scheduled"] == 50
    assert result["retried_after_idle_close"] == 0 and result["completed"] == 0
