"""The search where the planner knows little (issue 19): vLLM's own knobs in a trainer that always runs
vLLM, knob directions learned from measurements, an OOM's odds where it proves nothing, the stop at a
measured local optimum, and the knobs the prior cannot see."""

from autotune.candidate.space_file import load_space
from autotune.hardware import find_gpu_type
from autotune.models import resolve_model
from autotune.recipe import Recipe
from autotune.search.headroom import save_risks, unmeasured_risks
from autotune.search.knobs import KnobMemory
from autotune.search.momentum import flat_knobs
from autotune.search.planner import Planner
from autotune.search.walk import Walk
from autotune.study import candidate_key, rows
from autotune.study.ranking import Confirmation, choose_best, eligible
from autotune.trial.outcome import Status

PPO_SPACE = """
version: 1
global_batch:
  micro_batch: micro_train_batch_size
parameters:
  micro_train_batch_size: {type: int, choices: [1, 2, 4, 8, 16], default: 4}
  zero_stage: {type: int, choices: [2, 3], default: 2}
  adam_offload: {type: bool, choices: [false, true], default: false}
  colocate_all_models: {type: bool, choices: [false, true], default: false}
  vllm_gpu_memory_utilization: {type: float, low: 0.3, high: 0.9, step: 0.1, default: 0.5}
"""
PPO = dict(
    micro_train_batch_size=8,
    zero_stage=2,
    adam_offload=False,
    colocate_all_models=False,
    vllm_gpu_memory_utilization=0.5,
)


def ppo_planner(tmp_path):
    path = tmp_path / "ppo.yaml"
    path.write_text(PPO_SPACE)
    return space_planner(path, "Qwen2.5-7B-Instruct")


def space_planner(path, model):
    """A planner for a trainer in its own knob names (the space at ``path``) on 8 x A100-80GB."""
    space = load_space(path)
    gpu = find_gpu_type("A100-80GB")
    recipe = Recipe(
        model=model,
        gpus=8,
        gpu_type=gpu.name,
        gpu_memory_gib=gpu.memory_gib,
        runner="command",
        space=str(path),
        global_batch=64,
    )
    return Planner(resolve_model(recipe.model), recipe, gpu, knobs=KnobMemory.of(space)), space


def test_a_trainer_that_always_runs_vllm_learns_from_its_vllm_failures(tmp_path):
    """Seen: a PPO trainer (no use_vllm switch, vLLM always on its GPUs) failed vLLM's start-up 20
    times at fractions 0.3 to 0.9: a start-up failure vetoed only its exact twin. vLLM's fraction is
    vLLM's own knob: a larger one beside as much trainer state fails to start too, a smaller one
    finds less KV cache."""
    planner, _ = ppo_planner(tmp_path)
    planner.observe(1, PPO, "oom", "vllm_startup", None)
    assert planner.verdict({**PPO, "vllm_gpu_memory_utilization": 0.7}).skip
    assert planner.verdict({**PPO, "vllm_gpu_memory_utilization": 0.7, "micro_train_batch_size": 1}).skip
    assert not planner.verdict({**PPO, "vllm_gpu_memory_utilization": 0.3}).skip  # the cure
    assert not planner.verdict({**PPO, "zero_stage": 3, "vllm_gpu_memory_utilization": 0.7}).skip
    assert not planner.verdict({**PPO, "adam_offload": True}).skip  # unknown knob: says nothing
    planner.observe(2, {**PPO, "vllm_gpu_memory_utilization": 0.3}, "oom", "vllm_kv", None)
    assert not planner.verdict({**PPO, "vllm_gpu_memory_utilization": 0.4}).skip
    planner.observe(3, {**PPO, "zero_stage": 3, "vllm_gpu_memory_utilization": 0.4}, "oom", "vllm_kv", None)
    assert planner.verdict({**PPO, "zero_stage": 3, "vllm_gpu_memory_utilization": 0.3}).skip


def test_a_knobs_direction_is_learned_from_one_knob_pairs_at_two_settings_of_the_others(tmp_path):
    """An undeclared knob (adam_offload) first carries no dominance. An OOM and a success that differ
    in it alone show its direction at one setting of the other knobs (a hint); once a pair at
    another setting agrees, an OOM with offload on vetoes it off."""
    planner, _ = ppo_planner(tmp_path)
    big = {**PPO, "micro_train_batch_size": 16, "zero_stage": 3}
    planner.observe(1, {**big, "adam_offload": True}, "oom", "cuda", None)
    assert not planner.verdict(big).skip  # unknown yet
    planner.observe(2, PPO, "oom", "cuda", None)  # ZeRO-2: needs more than big by the known knobs
    planner.observe(3, {**PPO, "adam_offload": True}, "ok", None, None, 2.0)  # no peak: none logged
    assert planner.knobs.hinted == {"adam_offload": "down"} and planner.knobs.learned == {}
    assert not planner.verdict(big).skip  # one setting of the others: no veto yet
    colocated = {**PPO, "colocate_all_models": True}
    planner.observe(4, colocated, "oom", "cuda", None)
    planner.observe(5, {**colocated, "adam_offload": True}, "ok", None, None, 2.0)
    assert planner.knobs.learned == {"adam_offload": "down"} and planner.knobs.hinted == {}
    assert planner.verdict(big).skip
    assert "trial 1" in planner.verdict(big).reason
    # but a learned direction does not take an unmeasured peak off the edge: seen, plain 8B on
    # 8 x 80 GB, micro 16 at the edge ran in some trials and died in others, three do-nothing knobs
    # were 'learned' from those pairs, and what was exported died in the long run (0.00); only a
    # longer run that holds clears it, and only where offload was also measured to cost speed, as a
    # saver does (the next test): one OOM/ok pair at a 50/50 edge is a coin
    risks, clears = unmeasured_risks(planner, 0.03)
    assert set(risks) == {"3", "5"} and clears == []
    # a pair that says the opposite leaves the knob unknown again
    planner.observe(6, {**PPO, "micro_train_batch_size": 4}, "ok", None, None, 1.5)
    planner.observe(7, {**PPO, "micro_train_batch_size": 4, "adam_offload": True}, "oom", "cuda", None)
    assert planner.knobs.learned == {} and planner.knobs.hinted == {}


def test_a_direction_seen_at_one_setting_of_the_others_vetoes_nothing(tmp_path):
    """Seen (PPO 1.5B on 8 x 24 GB): one pair at ZeRO-2 showed that colocating the four models needs
    more memory, and an OOM at ZeRO-3 without colocation then ruled out the landscape's best,
    colocated at ZeRO-3, which fits. Colocation puts every model's states on every GPU but lets
    vLLM sleep while they train, so which way it goes depends on the other knobs. A direction now
    carries dominance once pairs at two settings of the others agree: a stated prior, not a model
    of which knobs interact (two settings at ZeRO-2 still rule at ZeRO-3, as the end shows)."""
    planner, _ = ppo_planner(tmp_path)
    apart = {**PPO, "micro_train_batch_size": 4, "zero_stage": 3}  # not colocated
    planner.observe(1, apart, "oom", "cuda", None)
    best = {**apart, "colocate_all_models": True}
    low = {**PPO, "micro_train_batch_size": 2}  # ZeRO-2
    planner.observe(2, low, "ok", None, None, 2.0)
    planner.observe(3, {**low, "colocate_all_models": True}, "oom", "cuda", None)
    assert planner.knobs.hinted == {"colocate_all_models": "up"} and planner.knobs.learned == {}
    assert not planner.verdict(best).skip
    other = {**low, "adam_offload": True}  # another setting of the others, the same direction
    planner.observe(4, other, "ok", None, None, 2.0)
    planner.observe(5, {**other, "colocate_all_models": True}, "oom", "cuda", None)
    assert planner.knobs.learned == {"colocate_all_models": "up"}
    verdict = planner.verdict(best)
    # a known limit: both settings are at ZeRO-2, and say no more of ZeRO-3 than one did
    assert verdict.skip and "trial 1" in verdict.reason, verdict


def test_the_same_configuration_measured_twice_is_one_setting(tmp_path):
    """A configuration can be measured twice (an OOM re-run, a confirmation that died, an OOM learned
    again on resume): its pairs with one neighbour are one setting of the other knobs, not two."""
    planner, _ = ppo_planner(tmp_path)
    low = {**PPO, "micro_train_batch_size": 2}
    planner.observe(1, low, "ok", None, None, 2.0)
    planner.observe(2, {**low, "colocate_all_models": True}, "oom", "cuda", None)
    planner.observe(3, {**low, "colocate_all_models": True}, "oom", "cuda", None)
    planner.observe(4, low, "ok", None, None, 2.1)
    assert planner.knobs.hinted == {"colocate_all_models": "up"} and planner.knobs.learned == {}
    apart = {**PPO, "micro_train_batch_size": 4, "zero_stage": 3}
    planner.observe(5, apart, "oom", "cuda", None)
    assert not planner.verdict({**apart, "colocate_all_models": True}).skip


def test_an_unmeasured_peak_a_learned_knob_sets_apart_is_cleared_by_a_longer_run_that_holds(tmp_path):
    """Seen: a plain trainer logging no memory on 8 x 80 GB: micro-batch 8 ran out of memory without
    activation offload, nine trials of micro-batch 8 with it ran fine, and all nine were passed over as
    at the edge of that OOM; micro-batch 4 was exported (0.85 of the best possible). A knob measured
    to need less memory may be why one ran and the other died, or an edge's coin: the confirmation, a
    run as long as the export is judged by, tells them apart. Where nothing learned sets a success
    apart from the OOM, no run clears it."""
    planner, _ = ppo_planner(tmp_path)
    planner.observe(0, PPO, "oom", "cuda", None)
    off = {**PPO, "adam_offload": True}
    planner.observe(1, off, "ok", None, None, 2.0)  # no peak logged; adam_offload alone apart
    wide = {**PPO, "micro_train_batch_size": 16, "colocate_all_models": True}
    planner.observe(2, wide, "ok", None, None, 3.0)  # apart only in a knob nothing showed the way of
    small = {**PPO, "micro_train_batch_size": 4}
    planner.observe(3, small, "ok", None, None, 1.0)
    assert planner.knobs.hinted == {"adam_offload": "down"} and planner.knobs.learned == {}
    risks, clears = unmeasured_risks(planner, 0.03)
    # the direction rests on one OOM/ok pair, a coin at the edge; a saver also costs speed, and
    # nothing measured offload's yet
    assert set(risks) == {"1", "2"} and clears == []
    planner.observe(4, {**small, "adam_offload": True}, "ok", None, None, 0.8)  # 20% slower
    risks, clears = unmeasured_risks(planner, 0.03)
    assert set(risks) == {"1", "2"} and clears == ["1"]
    assert unmeasured_risks(planner, 0.15)[1] == []  # within twice a 15% noise: not a measured cost

    # kept in the study where the ranking reads it
    import optuna

    study = optuna.create_study(direction="maximize")
    lean = {**small, "adam_offload": True}
    for params, value in ((PPO, None), (off, 2.0), (wide, 3.0), (small, 1.0), (lean, 0.8)):  # trials 0-4
        attrs = {"candidate": params, "launched": True, "status": "ok" if value else "oom"}
        if value:
            attrs["throughput"] = value
        study.add_trial(optuna.trial.create_trial(value=value or 0.0, user_attrs=attrs))
    save_risks(study, planner)
    table = rows(study)
    assert [r.long_run_clears for r in table] == [False, True, False, False, False]
    recipe = planner.recipe

    # no longer run yet: the export passes both over; the confirmations may run the cleared one
    assert [r.number for r in eligible(table, recipe)[0]] == [3, 4]
    assert [r.number for r in eligible(table, recipe, confirming=True)[0]] == [1, 3, 4]
    held = Confirmation(Status.OK, 2.1, None, 11)
    best, _ = choose_best(table, recipe, {1: held})
    assert best.number == 1
    died = Confirmation(Status.OOM, steps=7, oom_kind="cuda")
    best, notes = choose_best(table, recipe, {1: died})
    assert best.number == 3 and any("died in its longer confirmation run" in n for n in notes), notes
    # a held run does not clear a success nothing learned sets apart from the OOM
    best, notes = choose_best(table, recipe, {2: held})
    assert best.number == 3 and any("peak was not measured and trial 0" in n for n in notes), notes
    # the dashboard reads the same verdicts from the storage (it exported trial 2 before)
    from autotune.study.dashboard import decisions

    exported, verdicts = decisions(study.get_trials(), study.user_attrs, recipe)
    assert exported == 3 and verdicts[2].startswith("passed over: its peak was not measured"), verdicts

    # the noise save_risks judges a saver's cost by is the confirmations' where only a hint exists:
    # trial 3's longer run 30% above its short trial puts offload's 20% within twice the noise
    from autotune.study.ranking import save_confirmation
    from autotune.trial.outcome import Outcome

    save_confirmation(study, 3, Outcome(status=Status.OK, throughput=1.3, steps=21))
    save_risks(study, planner)
    assert [r.long_run_clears for r in rows(study)] == [False] * 5
    save_confirmation(study, 3, Outcome(status=Status.OK, throughput=1.0, steps=21))
    save_risks(study, planner)
    assert [r.long_run_clears for r in rows(study)] == [False, True, False, False, False]


def test_the_calibrated_model_vetoes_only_at_settings_of_the_knobs_it_cannot_read_it_measured(tmp_path):
    """Seen: PPO 1.5B on 8 x 24 GB, the calibrated model vetoed the landscape's best configuration
    (colocated models at ZeRO-3; 46 GiB predicted on 22 GiB cards; it fits): the model reads none of
    the trainer's own knobs, and every peak that calibrated it was measured without colocation. As an
    OOM over a knob of unknown effect (issue 19 item 3), it speaks only for the settings of those
    knobs it was measured at."""
    path = tmp_path / "ppo.yaml"
    path.write_text(PPO_SPACE)
    planner, _ = space_planner(path, "Qwen3-14B")  # micro-batch 8 just keeps the headroom free
    apart = {**PPO, "zero_stage": 2}
    small = [{**apart, "micro_train_batch_size": mb} for mb in (2, 4, 8)]
    colocated = {**apart, "micro_train_batch_size": 1, "colocate_all_models": True}
    peaks = [planner.predict(c) for c in [*small, colocated]]  # the trainer runs as the model says
    for number, (params, peak) in enumerate(zip(small, peaks)):
        planner.observe(number, params, "ok", None, peak, 1.0 + number)
    assert planner.model_trusted
    big = {**apart, "micro_train_batch_size": 16}
    assert planner.verdict(big).skip and "capacity" in planner.verdict(big).reason  # where measured
    assert not planner.verdict({**big, "colocate_all_models": True}).skip  # never measured colocated
    # a colocated success without a logged peak calibrates nothing
    planner.observe(8, {**colocated, "micro_train_batch_size": 2}, "ok", None, None, 1.0)
    assert not planner.verdict({**big, "colocate_all_models": True}).skip
    planner.observe(9, colocated, "ok", None, peaks[3], 1.0)
    verdict = planner.verdict({**big, "colocate_all_models": True})
    assert verdict.skip and "capacity" in verdict.reason
    # a knob declared to move no memory is no setting the model must have seen
    declared = KnobMemory(declared={"colocate_all_models": "none"})
    assert declared.model_blind({**big, "colocate_all_models": True}) == declared.model_blind(big)
    # TRL's names, vLLM's knobs beside a use_vllm switch and ms-swift's sleep_level are all read
    trl = {
        "per_device_train_batch_size": 4,
        "zero_stage": 3,
        "use_vllm": True,
        "vllm_gpu_memory_utilization": 0.3,
    }
    assert KnobMemory().model_blind({**trl, "sleep_level": 1}) == ()
    assert KnobMemory().model_blind({**trl, "offload_model": True}) == (("offload_model", "True"),)
    server = {**trl, "vllm_mode": "server"}  # vLLM on other GPUs: its knobs move none of these
    assert KnobMemory().model_blind(server) == ()


def test_the_model_calibrated_where_less_memory_was_needed_still_vetoes(tmp_path):
    """The review of the rule above: a peak measured where the knobs the model cannot read need less
    memory than the candidate's (a smaller vLLM fraction, Adam offload on) makes the model's prediction
    a lower bound there, so its veto stays sound; calibrated where they need more, it may not judge."""
    path = tmp_path / "ppo.yaml"
    path.write_text(PPO_SPACE)
    planner, _ = space_planner(path, "Qwen3-14B")  # micro-batch 8 just keeps the headroom free
    small = [{**PPO, "micro_train_batch_size": mb} for mb in (2, 4, 8)]  # vLLM's fraction 0.5
    for number, params in enumerate(small):
        planner.observe(number, params, "ok", None, planner.predict(params), 1.0 + number)
    assert planner.model_trusted
    big = {**PPO, "micro_train_batch_size": 16}
    for fraction, judged in ((0.5, True), (0.7, True), (0.4, False)):
        params = {**big, "vllm_gpu_memory_utilization": fraction}
        verdict = planner.verdict(params)
        assert verdict.skip is judged and planner.reads(params) is judged, fraction
        assert ("capacity" in (verdict.reason or "")) is judged
    # a knob of unknown direction must agree; one of known direction may need more than measured
    knobs = KnobMemory(declared={"adam_offload": "down"})
    offloaded = {**PPO, "adam_offload": True}
    assert knobs.bounds_below(offloaded, PPO) and not knobs.bounds_below(PPO, offloaded)
    assert not knobs.bounds_below(offloaded, {**PPO, "colocate_all_models": True})
    assert not KnobMemory().bounds_below(offloaded, PPO)  # adam_offload's direction unknown
    # a knob of choices is ordered as the space lists them; a value it does not list, or a knob one
    # of the two lacks, is no bound
    sizes = KnobMemory(declared={"cache": "up"}, choices={"cache": ("small", "large")})
    small, large = {**PPO, "cache": "small"}, {**PPO, "cache": "large"}
    assert sizes.bounds_below(small, large) and not sizes.bounds_below(large, small)
    assert not sizes.bounds_below({**PPO, "cache": "tiny"}, large)
    assert not sizes.bounds_below(PPO, large) and not sizes.bounds_below(small, PPO)
    assert sizes.split({"cache": "tiny"}) == ((), (("cache", "'tiny'"),))  # dominance: equal only
    assert sizes.split({"cache": "large"}) == ((1.0,), ())


def test_the_model_vetoes_a_micro_batch_far_beyond_its_calibration_only_with_the_wider_margin(tmp_path):
    """A review's case: a trainer whose peak holds a part the model cannot represent (10 GiB per unit
    of vLLM's fraction, a knob it does not read), every calibrating peak at micro-batch 1. The fit puts
    that part in the activations' weight, and micro-batch 16 came out at 98 GiB against 62 in truth,
    vetoed on 80 GB cards. Beyond twice the largest calibrated micro-batch the model extrapolates, and
    vetoes only with the margin of an unmeasured regime; a peak measured nearer lets it judge again."""
    path = tmp_path / "ppo.yaml"
    path.write_text(PPO_SPACE)
    planner, _ = space_planner(path, "Qwen2.5-7B-Instruct")

    def truth(params):
        return planner.raw(params).total_gib + 10 * params["vllm_gpu_memory_utilization"]

    for number, fraction in enumerate((0.9, 0.9, 0.9, 0.3)):
        params = {**PPO, "micro_train_batch_size": 1, "vllm_gpu_memory_utilization": fraction}
        planner.observe(number, params, "ok", None, truth(params), 1.0)
    assert planner.model_trusted
    big = {**PPO, "micro_train_batch_size": 16, "vllm_gpu_memory_utilization": 0.5}
    cap = planner.recipe.gpu_memory_gib
    assert truth(big) < cap < planner.predict(big) < cap * (1 + planner.unexplored_margin)
    assert not planner.verdict(big).skip
    assert planner.veto_margin(big) == planner.unexplored_margin
    near = {**big, "micro_train_batch_size": 8}
    planner.observe(4, near, "ok", None, None, 1.0)  # a success whose peak was not measured
    assert planner.veto_margin(big) == planner.unexplored_margin  # calibrates nothing
    planner.observe(5, near, "ok", None, truth(near), 1.0)
    assert planner.veto_margin(big) < planner.unexplored_margin  # 16 is twice 8: no longer far
    planner.rel_error = 0.2  # a model this wrong keeps twice its error, wider than the regime's
    assert planner.veto_margin(big) == 0.4 and planner.veto_margin({**big, "zero_stage": 3}) == 0.4
    planner.rel_error = 0.05
    assert planner.veto_margin({**big, "zero_stage": 3}) == planner.unexplored_margin  # never ran


def test_a_knob_that_does_not_move_the_measured_peak_is_learned_as_none(tmp_path):
    """Seen: the plain trainer's dataloader_workers changes nothing, yet each OOM at micro-batch 16
    vetoed only its twin with the same workers. Two measured peaks within 2% that differ in that knob
    alone say memory does not depend on it: then an OOM rules out every value of it."""
    planner, _ = ppo_planner(tmp_path)
    big = {**PPO, "micro_train_batch_size": 16}
    planner.observe(1, big, "oom", "cuda", None)
    assert not planner.verdict({**big, "colocate_all_models": True}).skip
    planner.observe(2, PPO, "ok", None, 40.0, 2.0)
    planner.observe(3, {**PPO, "colocate_all_models": True}, "ok", None, 40.5, 2.1)
    assert planner.knobs.hinted == {"colocate_all_models": "none"}
    assert not planner.verdict({**big, "colocate_all_models": True}).skip  # one setting of the others
    small = {**PPO, "micro_train_batch_size": 4}
    planner.observe(4, small, "ok", None, 30.0, 1.5)
    planner.observe(5, {**small, "colocate_all_models": True}, "ok", None, 30.3, 1.5)
    assert planner.verdict({**big, "colocate_all_models": True}).skip
    assert planner.knobs.learned == {"colocate_all_models": "none"}


def test_an_oom_that_proves_nothing_still_lowers_the_odds(tmp_path):
    """Seen: eight trials at the micro-batch that had run out of memory, each with another unknown knob
    changed. Such an OOM vetoes nothing, but it halves the expected throughput of what it would
    dominate by the known knobs, so the walk tries likelier candidates first."""
    planner, _ = ppo_planner(tmp_path)
    twin = {**PPO, "micro_train_batch_size": 16, "colocate_all_models": True}
    before = planner.expected_throughput(twin)
    planner.observe(1, {**PPO, "micro_train_batch_size": 16}, "oom", "cuda", None)
    assert not planner.verdict(twin).skip
    assert planner.expected_throughput(twin) == 0.5 * before
    smaller = {**PPO, "micro_train_batch_size": 8, "colocate_all_models": True}
    assert planner.expected_throughput(smaller) == planner.prior(smaller)


def test_a_measured_local_optimum_stops_without_a_prior(tmp_path):
    """The convergence stop read only the prior, which does not describe a trainer in its own names:
    such searches never stopped early. Every neighbour of the best measured or ruled out (knobs
    measured to change nothing passed over) is a stop that needs no prior."""
    from autotune.search.prior_check import local_optimum

    planner, space = ppo_planner(tmp_path)
    fixed = {"vllm_gpu_memory_utilization": 0.5, "zero_stage": 2}
    best = {**PPO, "micro_train_batch_size": 4}
    planner.observe(1, best, "ok", None, 40.0, 3.0)
    tried = {candidate_key(best)}
    assert not local_optimum(Walk.of(planner, space, fixed, [], tried, candidate_key))
    planner.observe(2, {**best, "micro_train_batch_size": 8}, "oom", "cuda", None)
    for n, change in enumerate(
        [
            {"micro_train_batch_size": 2},
            {"adam_offload": True},
            {"colocate_all_models": True},
            {"micro_train_batch_size": 2, "adam_offload": True},
            {"micro_train_batch_size": 2, "colocate_all_models": True},
            {"micro_train_batch_size": 8, "adam_offload": True},
            {"micro_train_batch_size": 8, "colocate_all_models": True},
        ],
        start=3,
    ):
        cand = {**best, **change}
        assert not local_optimum(Walk.of(planner, space, fixed, [], tried, candidate_key)), change
        planner.observe(n, cand, "ok", None, 40.0, 2.0)
        tried.add(candidate_key(cand))
    # adam_offload x colocate is the last pair: measured flat, it is passed over
    assert not local_optimum(Walk.of(planner, space, fixed, [], tried, candidate_key))
    assert local_optimum(Walk.of(planner, space, fixed, [], tried, candidate_key), {"colocate_all_models"})


def test_a_knob_is_flat_within_the_measured_noise():
    """With 8% run-to-run noise two runs of one configuration differ by 8%: a knob whose pairs all
    differ by less than twice the noise is measured to change nothing, not only one under 5%."""

    class Seen:
        def __init__(self, params, throughput):
            self.params, self.throughput, self.status = params, throughput, "ok"

    class Knows:
        seen = [Seen({"a": 1, "b": 1}, 10.0), Seen({"a": 2, "b": 1}, 10.9), Seen({"a": 1, "b": 2}, 9.3)]
        seen += [Seen({"a": 2, "b": 2}, 9.95)]

    assert flat_knobs(Knows(), ["a", "b"]) == set()
    assert flat_knobs(Knows(), ["a", "b"], 0.08) == {"a", "b"}


def test_the_priors_nothing_better_says_nothing_of_knobs_it_cannot_see(tmp_path):
    """Seen: a PPO search stopped 'converged' at 85%: the prior, which reads TRL's knobs, expected
    nothing better, but it gives every value of colocate_all_models the same speed. Before that stop,
    the neighbours of the best that move a knob the prior cannot see must be measured."""
    from autotune.search.prior_check import blind_knobs, local_optimum

    planner, space = ppo_planner(tmp_path)
    fixed = {"vllm_gpu_memory_utilization": 0.5}
    blind = blind_knobs(planner, space, fixed, PPO)
    assert "colocate_all_models" in blind and "micro_train_batch_size" not in blind
    planner.observe(1, PPO, "ok", None, 40.0, 3.0)
    tried = {candidate_key(PPO)}
    assert not local_optimum(
        Walk.of(planner, space, fixed, [], tried, candidate_key), only={"colocate_all_models"}
    )
    for n, cand in enumerate(
        c
        for c in _neighbours(planner, space, fixed, PPO)
        if c["colocate_all_models"] != PPO["colocate_all_models"]
    ):
        planner.observe(10 + n, cand, "oom", "cuda", None)
        tried.add(candidate_key(cand))
    assert local_optimum(
        Walk.of(planner, space, fixed, [], tried, candidate_key), only={"colocate_all_models"}
    )


def _neighbours(planner, space, fixed, params):
    from autotune.candidate.moves import neighbors

    return neighbors(params, space, fixed, planner.recipe)


def test_a_runner_up_whose_knob_pays_is_followed_when_it_promises_a_new_best(tmp_path):
    """Seen: 7B on 4 x 80 GB exported 0.88 without checkpointing at batch 2; checkpointing at batch 4
    had measured 6.08/s against 5.17/s at batch 2 (+18%), 10% behind the best, and batch 8 with it
    (the best possible) was never tried: only the incumbent's paying knob was followed."""
    from autotune.search.momentum import promising_onward

    planner, space = ppo_planner(tmp_path)
    fixed = {"vllm_gpu_memory_utilization": 0.5}
    lean = {**PPO, "adam_offload": True}
    planner.observe(1, PPO, "ok", None, 60.0, 6.72)  # the best
    planner.observe(2, {**lean, "micro_train_batch_size": 2}, "ok", None, 30.0, 5.17)
    planner.observe(3, {**lean, "micro_train_batch_size": 4}, "ok", None, 40.0, 6.08)
    tried = {candidate_key(s.params) for s in planner.seen}
    nxt = promising_onward(Walk.of(planner, space, fixed, [], tried, candidate_key), 6.72)
    assert nxt == {**lean, "micro_train_batch_size": 8}
    # a runner-up whose step gained too little to beat the best is not followed
    assert promising_onward(Walk.of(planner, space, fixed, [], tried, candidate_key), 7.5) is None


def plain_planner():
    """The benchmark's plain trainer (its space as the repository ships it: no knob declares its
    effect on memory) on 8 x 80 GB."""
    from pathlib import Path

    import autotune.sim

    return space_planner(Path(autotune.sim.__file__).parent / "spaces" / "plain.yaml", "Llama-3.1-8B")


def test_a_knob_measured_to_cost_speed_is_asked_whether_it_saves_the_memory_the_next_batch_needs():
    """Seen: a trainer logging no memory, 8 x 80 GB: micro-batch 8 ran out of memory without
    activation offload; offload ran 24% slower at micro-batch 4 and was never tried at 8, where the
    best configurations are (offload halves the activations' memory); micro-batch 4 was exported at
    0.81 of the best possible. Without peaks no pair shows offload's direction, so the trade (a saver
    on, a larger micro-batch) never took it: the OOM is now asked again with offload on."""
    from autotune.search.trade import saver_experiment

    planner, space = plain_planner()
    base = dict(
        micro_batch_size=4, activation_offload=False, dataloader_workers=0, log_interval=1, fused_adam=True
    )
    planner.observe(1, base, "ok", None, None, 4.78)  # no peak: the trainer logs none
    planner.observe(2, {**base, "log_interval": 10}, "ok", None, None, 4.77)  # costs nothing
    planner.observe(4, {**base, "micro_batch_size": 8}, "oom", "cuda", None)
    tried = {candidate_key(p) for p in (base, {**base, "log_interval": 10}, {**base, "micro_batch_size": 8})}

    def ask():
        return saver_experiment(Walk.of(planner, space, {}, [], tried, candidate_key), base, 0.03)

    assert ask() is None  # nothing measured to cost speed: no knob looks like a saver
    slow = {**base, "activation_offload": True}
    planner.observe(5, slow, "ok", None, None, 3.63)
    tried.add(candidate_key(slow))
    assert ask() == {**base, "activation_offload": True, "micro_batch_size": 8}
    # it ran: the pair with the OOM hints at offload's direction (the risk test reads it; the trade
    # and the walk once a second setting agrees)
    planner.observe(6, ask(), "ok", None, None, 5.97)
    assert planner.knobs.hinted == {"activation_offload": "down"} and planner.knobs.learned == {}
    tried.add(candidate_key({**base, "activation_offload": True, "micro_batch_size": 8}))
    assert ask() is None


def _plain_stuck():
    """The plain trainer's incumbent at micro-batch 4 (no peaks logged) whose micro-batch 8 ran out
    of memory, and the call asking for a saver experiment from it."""
    from autotune.search.trade import saver_experiment

    planner, space = plain_planner()
    base = dict(
        micro_batch_size=4, activation_offload=False, dataloader_workers=0, log_interval=1, fused_adam=True
    )
    planner.observe(1, base, "ok", None, None, 4.78)
    planner.observe(2, {**base, "micro_batch_size": 8}, "oom", "cuda", None)
    tried = {candidate_key(s.params) for s in planner.seen}

    def ask():
        return saver_experiment(Walk.of(planner, space, {}, [], tried, candidate_key), base, 0.03)

    return planner, base, tried, ask


def test_a_knob_looks_costly_only_where_every_pair_of_it_was_slower():
    """One pair at 8-10% noise makes a knob that does nothing look 6% slower about half the time
    (the noise is assumed 3% until a confirmation measures it): a value counts as a speed cost, what
    a saver looks like, only where every one-knob pair it takes part in measured it slower."""
    planner, base, tried, ask = _plain_stuck()
    planner.observe(3, {**base, "micro_batch_size": 2}, "ok", None, None, 3.0)
    planner.observe(4, {**base, "micro_batch_size": 2, "log_interval": 10}, "ok", None, None, 2.6)
    tried |= {candidate_key(s.params) for s in planner.seen}
    assert ask() == {**base, "micro_batch_size": 8, "log_interval": 10}  # one pair: 13% slower
    planner.observe(5, {**base, "log_interval": 10}, "ok", None, None, 4.80)  # and here faster
    tried |= {candidate_key(s.params) for s in planner.seen}
    assert ask() is None


def test_an_experiments_own_oom_starts_no_second_experiment():
    """A saver experiment that ran out of memory sits at the same micro-batch: were it a start too,
    a second costly knob would be moved from it, then a third (every subset of the costly knobs).
    Each costly knob is asked once, from the OOM of the incumbent's own values."""
    planner, base, tried, ask = _plain_stuck()
    planner.observe(3, {**base, "activation_offload": True}, "ok", None, None, 3.63)  # 24% slower
    planner.observe(4, {**base, "fused_adam": False}, "ok", None, None, 4.0)  # 16% slower
    tried |= {candidate_key(s.params) for s in planner.seen}
    asked = []
    for number in (5, 6, 7):
        cand = ask()
        if cand is None:
            break
        asked.append({n: v for n, v in cand.items() if v != base.get(n)})
        planner.observe(number, cand, "oom", "cuda", None)
        tried.add(candidate_key(cand))
    assert sorted(asked, key=repr) == [
        {"activation_offload": True, "micro_batch_size": 8},
        {"fused_adam": False, "micro_batch_size": 8},
    ]


def test_an_oom_holding_a_known_knobs_costly_value_is_still_where_an_experiment_starts(tmp_path):
    """Seen: PPO 1.5B on 8 x 24 GB, the only OOMs at the next micro-batch were with ZeRO-3, measured
    slower than ZeRO-2 (as sharding is): counted as an experiment's own OOM, none was a start, and
    colocating the models, measured slower and the saver there, was never asked (0.72 of the best
    possible, 0.83 before). Only knobs of unknown effect make an OOM an experiment's."""
    from autotune.search.trade import saver_experiment

    planner, space = ppo_planner(tmp_path)
    fixed = {"vllm_gpu_memory_utilization": 0.5}
    here = {**PPO, "micro_train_batch_size": 4}
    planner.observe(1, here, "ok", None, None, 2.0)
    planner.observe(2, {**here, "zero_stage": 3}, "ok", None, None, 1.7)  # ZeRO-3 costs speed
    planner.observe(3, {**here, "colocate_all_models": True}, "ok", None, None, 1.6)  # and so does this
    planner.observe(4, {**PPO, "zero_stage": 3}, "oom", "cuda", None)  # micro-batch 8
    tried = {candidate_key(s.params) for s in planner.seen}
    asked = saver_experiment(Walk.of(planner, space, fixed, [], tried, candidate_key), here, 0.03)
    assert asked == {**PPO, "zero_stage": 3, "colocate_all_models": True}, asked


def test_a_configuration_that_ran_and_died_shows_no_knobs_direction(tmp_path):
    """Seen in the benchmark (plain 8B on 8 x 80 GB, a trainer that logs no memory): micro-batch 16
    with fused Adam ran, then died in its longer confirmation run; its twin without fused Adam (a few
    percent slower: fused Adam changes speed only) held its own. The dead run and the twin made a
    one-knob OOM/ok pair that hinted fused Adam needs more memory; with the twin's measured cost that
    hint cleared the twin of the edge, and the export died in a long run. A configuration that both
    ran and died is at the edge, where the same run lives or dies by the allocator's luck: a pair
    with it shows the edge, not the knob."""
    planner, _ = ppo_planner(tmp_path)
    edge = {**PPO, "micro_train_batch_size": 16}
    twin = {**edge, "colocate_all_models": True}
    small = {**PPO, "micro_train_batch_size": 4}
    planner.observe(1, edge, "ok", None, None, 3.0)  # no peak logged
    planner.observe(2, twin, "ok", None, None, 2.7)
    planner.observe(3, small, "ok", None, None, 1.5)
    planner.observe(4, {**small, "colocate_all_models": True}, "ok", None, None, 1.3)  # slower here too
    assert unmeasured_risks(planner, 0.03) == ({}, [])  # no OOM yet: no edge
    planner.observe(1, edge, "oom", "cuda", None)  # trial 1's confirmation died
    assert planner.knobs.hinted == {} and planner.knobs.learned == {}
    risks, clears = unmeasured_risks(planner, 0.03)
    assert set(risks) == {"2"} and clears == [], (risks, clears)
    assert "trial 1, which needs no more memory" in risks["2"]

    # an OOM of a configuration that never ran still shows the way (the cleared case stands)
    planner, _ = ppo_planner(tmp_path)
    planner.observe(1, edge, "oom", "cuda", None)
    for number, params, value in (
        (2, twin, 2.7),
        (3, small, 1.5),
        (4, {**small, "colocate_all_models": True}, 1.3),
    ):
        planner.observe(number, params, "ok", None, None, value)
    assert planner.knobs.hinted == {"colocate_all_models": "down"}
    assert unmeasured_risks(planner, 0.03) == ({"2": risks["2"]}, ["2"])


def ppo_search(tmp_path, execute=None, **fields):
    """A search of the PPO trainer in its own knob names, through ``--command``, on 8 x A100-80GB
    (opened again on the same SQLite study, as ``autotune resume`` does), and how it is told a
    trial's outcome."""
    from dataclasses import replace

    from autotune.progress import Reporter
    from autotune.runners import TrialContext
    from autotune.search.loop import Search
    from autotune.study import StudyPaths

    planner, space = ppo_planner(tmp_path)
    command = "python train.py --micro {micro_train_batch_size} --zero {zero_stage} --off {adam_offload}"
    recipe = replace(
        planner.recipe,
        command=command
        + " --colocate {colocate_all_models} --vllm {vllm_gpu_memory_utilization} --gb {global_batch}",
        name="p",
        **fields,
    )
    context = TrialContext(recipe, space, planner.model, planner.gpu)
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    search = Search(
        recipe,
        StudyPaths(tmp_path, "p"),
        context,
        Reporter(10),
        execute=execute,
        storage=storage,
        report=False,
    )
    study = search.open().study

    def told(params, outcome):
        search.tell(study.ask(), params, candidate_key(params), outcome)

    return search, study, told


def test_a_resumed_study_remembers_the_edge_a_dead_confirmation_found(tmp_path):
    """A leader's confirmation that ran out of memory puts the successes beside it at the edge. A
    resumed study learned only its trials and the production run's OOMs, so the first trial after
    the resume rewrote the risk list without that edge, and the export could pick a success the
    dead run had put at risk."""
    from autotune.study.incidents import Incident, save_incident
    from autotune.study.ranking import confirmations, save_confirmation
    from autotune.trial.outcome import Outcome

    edge = {**PPO, "micro_train_batch_size": 16}
    search, study, told = ppo_search(tmp_path)
    for params, value in (
        (edge, 3.0),
        ({**edge, "colocate_all_models": True}, 2.9),
        ({**PPO, "micro_train_batch_size": 4}, 1.5),
    ):
        told(params, Outcome(status=Status.OK, throughput=value, steps=5, launched=True))
    assert not study.user_attrs.get("at_risk")
    # trial 0's longer run dies as confirm() records it: the study keeps it, the planner learns it
    save_confirmation(study, 0, Outcome(status=Status.OOM, oom_kind="cuda", steps=6, launched=True))
    search.planner.observe(0, edge, Status.OOM, "cuda", None)
    save_risks(study, search.planner)
    assert set(study.user_attrs["at_risk"]) == {"1"}  # apart only in a knob of unknown direction

    # a confirmation that held is no OOM; attributes not as autotune writes them are left out, and a
    # production run's OOM is learned as before
    save_confirmation(study, 2, Outcome(status=Status.OK, throughput=1.4, steps=11, launched=True))
    for key, value in (
        ("confirm:x", {"status": "oom"}),
        ("confirm:7", "oom"),
        ("confirm:8", {"status": "?"}),
    ):
        study.set_user_attr(key, value)
    lost = {**edge, "vllm_gpu_memory_utilization": 0.9}  # needs more than any success
    save_incident(study, Incident(1, 1, "oom", "cuda", 120, "CUDA out of memory", lost))
    ooms = sorted((s.number, s.params == edge) for s in search.planner.seen if s.status == Status.OOM)
    assert ooms == [(0, True)]

    search, study, told = ppo_search(tmp_path)  # resumed
    ooms = sorted((s.number, s.params == edge) for s in search.planner.seen if s.status == Status.OOM)
    assert ooms == [(-1, False), (0, True)], search.planner.seen
    told({**PPO, "micro_train_batch_size": 2}, Outcome(status=Status.OK, throughput=1.0, launched=True))
    assert set(study.user_attrs["at_risk"]) == {"1"}, study.user_attrs["at_risk"]
    best, notes = choose_best(rows(study), search.recipe, confirmations(study))
    assert best.params == {**PPO, "micro_train_batch_size": 4}, notes


def test_a_confirmation_that_held_sets_no_bar_once_its_trial_cannot_be_exported(tmp_path):
    """The leaders are confirmed until the best held confirmation leaves the rest no chance. A leader
    whose confirmation held can be put at the edge by the next leader's longer run dying (the two
    apart only in a knob of unknown direction); its figure then set a bar the export could not meet,
    no other leader was confirmed, and the export fell back to a short trial alone."""
    from autotune.search.confirm import confirm
    from autotune.study.ranking import confirmations
    from autotune.trial.outcome import Outcome

    edge = {**PPO, "micro_train_batch_size": 16}
    twin = {**edge, "colocate_all_models": True}
    small = {**PPO, "micro_train_batch_size": 4}
    runs = []

    def execute(params, trial_dir, number, control):
        assert control.purpose == "confirm"
        runs.append(params)
        if params == edge:
            return Outcome(status=Status.OOM, oom_kind="cuda", steps=6, launched=True)
        return Outcome(status=Status.OK, throughput=3.0 if params == twin else 1.5, steps=11, launched=True)

    search, study, told = ppo_search(tmp_path, execute, confirm=2)
    for params, value in (
        (twin, 3.0),
        (edge, 2.9),
        (small, 1.5),
        ({**PPO, "micro_train_batch_size": 2}, 1.0),
    ):
        told(params, Outcome(status=Status.OK, throughput=value, steps=5, launched=True))
    assert confirm(search.state, execute) == 3
    assert runs == [twin, edge, small]
    assert set(study.user_attrs["at_risk"]) == {"0"}  # the twin, once its neighbour's longer run died
    done = confirmations(study)
    best, notes = choose_best(rows(study), search.recipe, done)
    assert best.params == small and any("trial 2 was confirmed" in n for n in notes), notes

    # a leader a production run lost is neither confirmed nor a bar: the next one is confirmed
    from autotune.study.incidents import Incident, long_run_failures, save_incident

    runs.clear()
    (tmp_path / "lost").mkdir()
    search, study, told = ppo_search(tmp_path / "lost", execute, confirm=1)
    for params, value in ((twin, 3.0), (small, 1.5)):
        told(params, Outcome(status=Status.OK, throughput=value, steps=5, launched=True))
    save_incident(study, Incident(1, 1, "oom", "cuda", 300, "CUDA out of memory", twin))
    assert confirm(search.state, execute) == 1 and runs == [small]
    best, notes = choose_best(rows(study), search.recipe, confirmations(study), long_run_failures(study))
    assert best.params == small and any("trial 1 was confirmed" in n for n in notes), notes
