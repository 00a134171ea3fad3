"""The PF2LoRA paper's synthetic example: PF2LoRA recovers both true ranks; HETLoRA with a
too-small initial rank for client 1 underfits it."""

from fedpeft.synthetic import make_problem, run_hetlora, run_pf2lora


def test_pf2lora_recovers_each_clients_rank_and_hetlora_underfits():
    problem = make_problem()
    assert problem.true_ranks == [4, 2]
    pf2 = run_pf2lora(problem, steps=1000)
    het = run_hetlora(problem, steps=1000)
    assert pf2.ranks[-1] == [4, 2]
    assert max(pf2.test_loss[-1]) < 0.05
    # HETLoRA's client 1 starts at rank 1 < 4: it cannot represent its update
    assert het.ranks[-1][0] < problem.true_ranks[0]
    assert het.test_loss[-1][0] > 10 * pf2.test_loss[-1][0]
    assert het.distance[-1][0] > 5 * pf2.distance[-1][0]
