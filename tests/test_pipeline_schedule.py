"""Pipeline partitioning and schedules: complete, deadlock-free, and reaching their bubble formulas."""

import pytest

from pithtrain.distributed import schedule as P


def test_balanced_split_and_override():
    assert P.split_layers(8, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # remainder to the stages without embedding / head, middle first
    assert [len(s) for s in P.split_layers(6, 4)] == [1, 2, 2, 1]
    assert [len(s) for s in P.split_layers(6, 8)] == [0, 1, 1, 1, 1, 1, 1, 0]
    assert P.split_layers(4, 2, [1, 3]) == [[0], [1, 2, 3]]
    # DualPipeV balances ranks (stages r and V-1-r), not stages: the V's turn is one rank
    assert [len(s) for s in P.split_layers(6, 4, v_shape=True)] == [2, 2, 1, 1]  # 3 + 3 layers
    assert [len(s) for s in P.split_layers(6, 8, v_shape=True)] == [1, 1, 1, 1, 0, 1, 1, 0]
    with pytest.raises(ValueError, match="pp_layers"):
        P.split_layers(4, 2, [1, 2])


def test_v_shape_placement():
    chunks = [P.rank_chunks(r, 4, "dualpipev", 16) for r in range(4)]
    assert [[c.stage for c in cs] for cs in chunks] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert chunks[0][0].first and chunks[0][1].last  # rank 0 holds the first and the last stage
    assert not any(c.first or c.last for cs in chunks[1:] for c in cs)
    assert [c.stage for c in P.rank_chunks(2, 4, "1f1b", 16)] == [2]


def compute_ops(ops):
    """(kind, chunk, mb) of every forward / input-backward / weight-backward a rank runs."""
    out = []
    for o in ops:
        if o.kind == "FB":
            out += [("F", o.chunk, o.mb), ("B", o.b_chunk, o.b_mb), ("W", o.b_chunk, o.b_mb)]
        elif o.kind == "BW":
            out += [("B", o.chunk, o.mb), ("W", o.chunk, o.mb)]
        elif o.kind in ("F", "B", "W"):
            out.append((o.kind, o.chunk, o.mb))
    return out


@pytest.mark.parametrize("schedule,pp,M", [("1f1b", 2, 4), ("1f1b", 4, 8), ("1f1b", 4, 3),
                                           ("dualpipev", 2, 4), ("dualpipev", 4, 8), ("dualpipev", 3, 7),
                                           ("dualpipev", 8, 20)])
def test_every_op_once_and_sends_match_receives(schedule, pp, M):
    sched = P.build_schedule(schedule, pp, M)
    chunks = 2 if schedule == "dualpipev" else 1
    sends, recvs = [], []
    for r, ops in enumerate(sched):
        got = sorted(compute_ops(ops))
        want = sorted((k, c, m) for k in "FBW" for c in range(chunks) for m in range(M))
        assert got == want, (schedule, r)
        stages = P.rank_stages(r, pp, schedule)
        for o in ops:  # name each message (direction, receiving stage, mb, from, to)
            if o.kind == "SEND_F":
                sends.append(("F", stages[o.chunk] + 1, o.mb, r, o.peer))
            elif o.kind == "SEND_B":
                sends.append(("B", stages[o.chunk] - 1, o.mb, r, o.peer))
            elif o.kind == "RECV_F":
                recvs.append(("F", stages[o.chunk], o.mb, o.peer, r))
            elif o.kind == "RECV_B":
                recvs.append(("B", stages[o.chunk], o.mb, o.peer, r))
    assert sorted(sends) == sorted(recvs)
    # Per (direction, sender, receiver) the messages are sent and received in the same order
    # (NCCL matches point-to-point messages by order).
    for key in {(d, s, t) for d, _, _, s, t in sends}:
        order_s = [(v, m) for d, v, m, s, t in sends if (d, s, t) == key]
        order_r = [(v, m) for d, v, m, s, t in recvs if (d, s, t) == key]
        assert order_s == [x for x in order_s if x in order_r] and order_s == sorted(order_s, key=lambda x: x[1])
        r = key[2]
        recv_order = [(P.rank_stages(r, pp, schedule)[o.chunk], o.mb) for o in sched[r]
                      if o.kind == f"RECV_{key[0]}" and o.peer == key[1]]
        assert recv_order == order_s


COSTS = [dict(F=1, B=1, W=1), dict(F=2, B=2, W=1), dict(F=1, B=1, W=1, FB=2), dict(F=2, B=2, W=1, FB=3)]


@pytest.mark.parametrize("costs", COSTS)
@pytest.mark.parametrize("pp", [2, 4, 8])
def test_1f1b_bubble(pp, costs):
    for M in (pp, 2 * pp, 3 * pp + 1):
        makespan, busy, _ = P.simulate(P.schedule_1f1b(pp, M), "1f1b", **costs)
        assert [makespan - b for b in busy] == [P.bubble_formula("1f1b", pp, **costs)] * pp


@pytest.mark.parametrize("costs", COSTS)
@pytest.mark.parametrize("pp", [2, 3, 4, 8])
def test_dualpipev_bubble(pp, costs):
    for M in (2 * pp, 3 * pp + 1, 5 * pp):
        makespan, busy, _ = P.simulate(P.schedule_dualpipev(pp, M), "dualpipev", **costs)
        idle = [makespan - b for b in busy]
        assert max(idle) == P.bubble_formula("dualpipev", pp, **costs), (M, idle)


@pytest.mark.quick
def test_print_dualpipev_pp4_8_microbatches(capsys):
    """The schedule a reader can check by eye, and its bubble against the formula."""
    sched = P.schedule_dualpipev(4, 8)
    text = P.format_schedule(sched)
    print(text)
    print(P.format_schedule(sched, comm=True))
    makespan, busy, _ = P.simulate(sched, "dualpipev")
    idle = [makespan - b for b in busy]
    print(f"makespan {makespan}, idle per rank {idle}, formula (p-1)(F&B + B + W - 3W) = "
          f"{P.bubble_formula('dualpipev', 4)}")
    out = capsys.readouterr().out
    assert out.startswith("rank 0: F0.0 F0.1 F0.2 F0.3 F0.4 F0.5 F0.6 F1.0 B1.0 W1.0 F1.1")
    assert "rank 3: F0.0 F1.0 F0.1 F1.1" in out  # the turn of the V: chunk 0 feeds chunk 1 locally
    assert max(idle) == P.bubble_formula("dualpipev", 4) == 6  # 3 * (3 + 2 - 3)
    # against 1F1B on the same 4 ranks with the same layers (a 1F1B stage = two chunks):
    m1, b1, _ = P.simulate(P.schedule_1f1b(4, 8), "1f1b", F=2, B=2, W=2)
    assert max(m1 - b for b in b1) == 18 > max(idle)


def test_dualpipev_needs_two_microbatches_per_rank():
    with pytest.raises(ValueError, match="at least 2"):
        P.schedule_dualpipev(4, 7)


@pytest.mark.quick
def test_pipeline_viz_draws_a_simulated_timeline(tmp_path, capsys):
    import json

    from pithtrain import pipeline_viz
    _, _, timeline = P.simulate(P.schedule_dualpipev(2, 4), "dualpipev")
    d = tmp_path / "pipeline_timeline"
    d.mkdir()
    for r, ops in enumerate(timeline):
        recs = [{"op": str(o), "kind": o.kind, "start": s / 1000, "end": e / 1000} for o, s, e in ops]
        (d / f"rank{r}.json").write_text(json.dumps({"rank": r, "pp_rank": r, "step": 1, "ops": recs}))
    assert pipeline_viz.main([str(tmp_path), "--width", "26"]) == 0
    out = capsys.readouterr().out
    assert "rank   0 (pp 0) |FFFFB" in out and "idle 8%" in out  # 2 of 26 units, as simulated
    assert (d / "timeline.png").stat().st_size > 1000  # matplotlib is a dev dependency: always drawn
