"""Noise and clipping schedules: change σ or C between steps, like an LR scheduler.

Each scheduler changes one attribute of a ``DPOptimizer`` when ``step()`` is called (once
per epoch or per step, the caller's choice):

    StepSchedule:         v_t = v_0 γ^⌊t / step_size⌋
    ExponentialSchedule:  v_t = v_0 γ^t
    LambdaSchedule:       v_t = v_0 λ(t)

Privacy stays accounted: the engine's accountant records the σ of every step it takes, and
the RDP / PLD accountants compose heterogeneous steps (``accounting.accountant``). Changing C
does not change ε (the noise std is σ C, so the ratio σ stays what the accountant sees).

``state_dict`` / ``load_state_dict`` hold plain numbers (checkpoints load them with
``weights_only=True``).
"""

from workbench.checks import check_choice, check_count, check_max_grad_norm, check_noise_multiplier

CHECKS = {"noise_multiplier": check_noise_multiplier, "max_grad_norm": check_max_grad_norm}


class _Schedule:
    attribute = None  # "noise_multiplier" or "max_grad_norm"

    def __init__(self, optimizer, attribute: str):
        check_choice(attribute, "attribute", CHECKS)
        self.optimizer, self.attribute = optimizer, attribute
        if isinstance(getattr(optimizer, attribute), list):
            raise ValueError("schedules of per-layer clip norms are not supported; schedule a "
                             "single max_grad_norm")
        self.base = float(getattr(optimizer, attribute))
        self.last_epoch = 0

    def factor(self, t: int) -> float:
        raise NotImplementedError

    def step(self) -> None:
        self.last_epoch += 1
        value = self.base * self.factor(self.last_epoch)
        try:
            value = CHECKS[self.attribute](value)
        except ValueError as e:
            raise ValueError(f"the schedule gave {self.attribute} = {value!r} at step "
                             f"{self.last_epoch}: {e}") from None
        setattr(self.optimizer, self.attribute, value)

    def state_dict(self) -> dict:
        return {"base": self.base, "last_epoch": self.last_epoch}

    def load_state_dict(self, state: dict) -> None:
        self.base, self.last_epoch = float(state["base"]), int(state["last_epoch"])
        setattr(self.optimizer, self.attribute, self.base * self.factor(self.last_epoch))


class StepSchedule(_Schedule):
    """v_t = v_0 γ^⌊t / step_size⌋."""

    def __init__(self, optimizer, step_size: int, gamma: float,
                 attribute: str = "noise_multiplier"):
        self.step_size, self.gamma = check_count(step_size, "step_size"), float(gamma)
        super().__init__(optimizer, attribute)

    def factor(self, t: int) -> float:
        return self.gamma ** (t // self.step_size)


class ExponentialSchedule(_Schedule):
    """v_t = v_0 γ^t."""

    def __init__(self, optimizer, gamma: float, attribute: str = "noise_multiplier"):
        self.gamma = float(gamma)
        super().__init__(optimizer, attribute)

    def factor(self, t: int) -> float:
        return self.gamma ** t


class LambdaSchedule(_Schedule):
    """v_t = v_0 λ(t) for a function λ of the step count."""

    def __init__(self, optimizer, schedule, attribute: str = "noise_multiplier"):
        if not callable(schedule):
            raise TypeError(f"schedule must be a function of the step count; got {schedule!r}")
        self.schedule = schedule
        super().__init__(optimizer, attribute)

    def factor(self, t: int) -> float:
        return float(self.schedule(t))


__all__ = ["CHECKS", "ExponentialSchedule", "LambdaSchedule", "StepSchedule"]
