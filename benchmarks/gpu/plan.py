"""How the suite runs on a GPU machine that takes one command at a time, each for at most 10 minutes.

The stages are grouped into commands. Each command is one remote call (`bash benchmarks/gpu/run.sh
--group N`) that ends within COMMAND_S with the wheels' installation and the imports: its
stages' caps plus SETUP_S and END_MARGIN_S fit in it, and the suite stops starting stages when what is left of the
command would not hold one. A command writes at most FILES_BACK files into $OUT (one per stage, gpu.md,
gpu.json, suite.log, logs.tar.gz), the number a call brings back.

    python benchmarks/gpu/plan.py      # prints the commands in order, with each stage's budget
"""

from __future__ import annotations

from dataclasses import dataclass

# A machine is lent for 15 minutes of device time, its start (one to two minutes) and the transfers included:
# the first command holds what matters most, the second what the rest of a lease may hold (it follows at once,
# on the machine still warm), the third waits for a later lease.
COMMAND_S = 560.0  # one command, installation and imports included (a call may run 600 s)
SETUP_S = 40.0  # wheels installed offline, the environment printed, torch and mmpt imported (26 s on an H100)
END_MARGIN_S = 15.0  # the last report and log archive, run.sh's end
FILES_BACK = 8  # what one call brings back from $OUT
FILES_PER_COMMAND = 4  # gpu.md, gpu.json, suite.log, logs.tar.gz besides one file per stage

# Seconds each stage may take on the GPU, corpus building included.
CAPS: dict[str, float] = {
    "clip_vitb16": 190,
    "clip_profile": 80,
    "m2_encoder": 235,
    "loss_memory": 40,
    "space2": 60,
    "victor": 70,
    # On an H100 the first compiled step took 54 s from a cold inductor cache (5.6 s from a warm one), and a cap of
    # 110 s then ran out after it (benchmarks/results/gpu/command-2-clip_compile.json; command 3 measured it warm).
    "clip_compile": 200,
    "nccl": 20,
    "data_loader": 70,
}


@dataclass(frozen=True)
class Command:
    group: str
    stages: tuple[str, ...]

    def stage_seconds(self) -> float:
        return sum(CAPS[name] for name in self.stages)

    def seconds(self) -> float:
        return self.stage_seconds() + SETUP_S + END_MARGIN_S

    def files(self) -> int:
        return len(self.stages) + FILES_PER_COMMAND

    def shell(self) -> str:
        return f"bash benchmarks/gpu/run.sh --group {self.group}"


# In this order: the comparison with open_clip, the profile of its step and the M²-Encoder first; then the loss,
# SPACE-2, VICTOR and compilation; the one-GPU collectives and the CPU loader last.
COMMANDS = (
    Command("1", ("clip_vitb16", "clip_profile", "m2_encoder")),
    Command("2", ("loss_memory", "space2", "victor", "clip_compile")),
    Command("3", ("nccl", "data_loader")),
)


def group(name: str) -> Command:
    for command in COMMANDS:
        if command.group == name:
            return command
    raise KeyError(f"no command group {name!r}; the groups are {', '.join(c.group for c in COMMANDS)}")


def describe() -> str:
    """The plan as printed: each command, a single remote call, with its stages' budgets."""
    total = sum(command.seconds() for command in COMMANDS) / 60
    lines = [
        f"{len(COMMANDS)} commands, in this order, each a single remote call with `.whl` carried "
        f"(timeout 600 s; each ends within {COMMAND_S:.0f} s, about {total:.0f} minutes of device time together, "
        "starts not counted):",
    ]
    for index, command in enumerate(COMMANDS, 1):
        budgets = ", ".join(f"{name} {CAPS[name]:.0f} s" for name in command.stages)
        lines.append(
            f"  {index}. {command.shell()}    # {budgets}; stages {command.stage_seconds():.0f} s + setup "
            f"{SETUP_S:.0f} s + end {END_MARGIN_S:.0f} s = {command.seconds():.0f} s; {command.files()} files back"
        )
    lines += [
        "Each command's $OUT holds a stage-<name>.json per stage (written as the stage ends), gpu.md and gpu.json",
        "(rebuilt after every stage), suite.log and logs.tar.gz. Then, here, one report from the folders that came back:",
        "  python benchmarks/gpu/suite.py --merge FOLDER_1 FOLDER_2 FOLDER_3    # -> benchmarks/results/gpu/",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    print(describe())
