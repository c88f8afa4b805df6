"""time_interleaved gives each candidate its own TorchFunctionMode stack: a mode one candidate
leaves behind (a DP optimizer's batch follower, from step() to the next forward) never sees
the other candidate's ops, and the stack found on entry is back on exit."""

import torch
from torch.overrides import TorchFunctionMode

from workbench.bench.timing import time_interleaved


class Counter(TorchFunctionMode):
    def __init__(self, seen: list, tag: str):
        super().__init__()
        self.seen, self.tag = seen, tag

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.seen.append(self.tag)
        return func(*args, **(kwargs or {}))


def test_a_mode_left_by_one_candidate_sees_only_that_candidate():
    seen, x, cpu = [], torch.ones(3), torch.device("cpu")
    outer = Counter(seen, "outer")

    def leaves_a_mode():  # pushes a mode on its first call and leaves it there, like step()
        if not any(torch._C._get_function_stack_at(i).__class__ is Counter and
                   torch._C._get_function_stack_at(i).tag == "left"
                   for i in range(torch._C._len_torch_function_stack())):
            torch._C._push_on_torch_function_stack(Counter(seen, "left"))
        torch.add(x, 1)

    def plain():
        torch.mul(x, 2)

    depth = torch._C._len_torch_function_stack()  # an earlier test's follower may be there
    torch._C._push_on_torch_function_stack(outer)
    try:
        seen.clear()
        time_interleaved({"dp": leaves_a_mode, "plain": plain}, cpu, repeats=3)
        # 1 warm-up + 3 rounds: dp's torch.add each time, never plain's torch.mul, and the
        # mode found on entry sees neither
        assert seen == ["left"] * 4
        assert torch._C._len_torch_function_stack() == depth + 1
        assert torch._C._get_function_stack_at(depth) is outer
    finally:
        torch._C._pop_torch_function_stack()

