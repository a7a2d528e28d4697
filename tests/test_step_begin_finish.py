"""MemoryStep's begin / after_forward / finish, the sequence smf train (smf.train.steps) and the HF Trainer
(smf_kernels.hf) drive a sparse step through: begin plans the fill and runs the counting forward the plan asks for,
finish gives each table's rows to the observers' ``before_rows`` right before they step, finishes the step as
``finish_step`` does (the same bits), and drops a step whose finish raised, so that the loop's next ``begin``
starts afresh."""
import pytest
import torch
import torch.nn.functional as F

from smf_kernels.sparse import RowSparseAdamW, SparseMemoryController, StepObserver
from helpers import MemoryLM, random_background

VOCAB, WIDTH, SEQ = 40, 16, 5


def setup(seed=0):
    torch.manual_seed(seed)
    model = MemoryLM(VOCAB, WIDTH, n_keys=6, heads=2, topk=3, key_dim=8)
    controller = SparseMemoryController(model, rows_per_step=5, background=random_background(model, 4, 1))
    return model, controller, RowSparseAdamW([model.memory.values, model.alpha], lr=1e-2)


def batches(count, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (2, SEQ), generator=generator),
             torch.randint(0, VOCAB, (2, SEQ), generator=generator)) for _ in range(count)]


def loss_of(model, batch):
    tokens, targets = batch
    return F.cross_entropy(model(tokens, torch.ones(2, SEQ, dtype=torch.bool)).reshape(-1, VOCAB), targets.reshape(-1))


@pytest.mark.parametrize("micro_batches, step_tokens", [(1, None), (2, None), (2, 10 ** 9)])
def test_begin_and_finish_step_as_finish_step_does_and_hand_each_tables_rows_to_observers(micro_batches, step_tokens):
    """One micro-batch (rows selected after its forward), several with reads kept, several with a counting forward
    first: begin and finish give finish_step's weights, bit for bit, and before_rows sees the rows about to step."""
    finals, seen = [], []
    for driven in (False, True):
        model, controller, optimizer = setup()
        step = batches(micro_batches)
        if driven:
            class Keep(StepObserver):
                def before_rows(self, v, rows):
                    seen.append((v is model.memory.values, rows.clone(), v.detach()[rows].clone()))

            controller.observe(Keep())

            def count():
                for tokens, _ in step:
                    model(tokens, torch.ones(2, SEQ, dtype=torch.bool))

            plan = controller.begin(micro_batches, count, step_tokens=step_tokens)
            assert plan.counting_forward == (step_tokens is not None)
            for batch in step:
                loss = loss_of(model, batch)
                controller.after_forward()
                loss.backward()
            result = controller.finish(optimizer, max_grad_norm=0.5)
            assert controller.last is result and not result.skipped and float(result.grad_norm) > 0
            selected = result.selected["memory"]
        else:
            controller.begin_step(controller.plan(micro_batches, step_tokens=step_tokens))
            if controller.plan(micro_batches, step_tokens=step_tokens).counting_forward:
                with torch.no_grad():
                    for tokens, _ in step:
                        model(tokens, torch.ones(2, SEQ, dtype=torch.bool))
                controller.select_rows()
            for batch in step:
                loss = loss_of(model, batch)
                controller.after_forward()
                loss.backward()
            controller.finish_step(optimizer, max_grad_norm=0.5)
        finals.append((model.memory.values.detach().clone(), model.alpha.detach().clone()))
    assert all(torch.equal(a, b) for a, b in zip(*finals))
    [(is_table, rows, before)] = seen
    assert is_table and rows.numel() == 5
    kept = torch.isin(rows, selected)  # the hook saw every updated row before it moved
    assert torch.isin(selected, rows).all() and not torch.equal(finals[1][0][selected], before[kept])


def test_a_plan_that_needs_a_counting_forward_without_one_is_refused_before_the_step_begins():
    _, controller, _ = setup()
    with pytest.raises(ValueError, match="pass counting_forward"):
        controller.begin(2, step_tokens=10 ** 9)
    assert not controller.in_step


def test_a_refused_finish_drops_the_step_so_that_the_next_begins_afresh():
    model, controller, optimizer = setup()
    controller.begin(2)
    for batch in batches(2):
        loss_of(model, batch).backward()
    with pytest.raises(TypeError, match="needs an optimizer with step_rows"):
        controller.finish(torch.optim.AdamW([model.memory.values, model.alpha]), max_grad_norm=1.0)
    assert not controller.in_step and controller.last is None and model.memory.values.grad is None
    model.alpha.grad = None
    controller.begin(2)
    for batch in batches(2, seed=2):
        loss_of(model, batch).backward()
    assert controller.finish(optimizer).selected["memory"].numel() > 0
