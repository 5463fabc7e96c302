"""One line for an error of hydra's defaults list (`hydra_errors.one_line` asks these): a group
chosen twice, a deletion of nothing, a default that picks another group from a file whose keys
land under its own group (an experiment file without `# @package _global_`)."""

from __future__ import annotations

import re

# the package each group's files are read into: an experiment file sets the run's own keys
GROUP_PACKAGE = {g: g for g in ("model", "hardware", "workload", "planner", "executor")}
GROUP_PACKAGE["experiment"] = "_global_"


def defaults_list_line(text: str) -> str | None:
    """A choice or deletion the defaults list or the config refuses (`+experiment=x` twice,
    `~bogus`, `+model=tiny`), as one line with what to pass; None for another error."""
    twice = re.search(
        r"Multiple values for ([\w/]+)\. To override a value use 'override \S+: (\S+)'", text
    )
    if twice:  # `+experiment=x` where the defaults list already has an experiment
        group, value = twice.groups()
        return f"+{group}={value}: {group} has a value already; pass {group}={value} (no +)"
    gone = re.search(r"Could not delete from config\. '([^']+)' does not exist", text)
    if gone:  # `~out` (its value null) or `~bogus`: hydra's line named no fix
        return (
            f"~{gone.group(1)}: nothing to delete (no such key, or its value is null); leave "
            f"it out, or pass {gone.group(1)}=VALUE"
        )
    other = re.search(
        r"Could not delete from config\. The value of '([^']+)' is (.*) and not (.*)\.$", text
    )
    if other:  # `~key=3` where key is 2: hydra's line named no fix
        key, now, given = other.groups()
        return (
            f"~{key}={given}: {key} is {now}, not {given}; pass ~{key} to delete it whatever it is"
        )
    again = re.search(r"^([\w/]+) appears more than once in the final defaults list", text)
    if again:  # `+model=tiny`: a second choice of a group the defaults list has
        group = again.group(1)
        return f"{group}: chosen twice (+{group}=... adds a choice); pass {group}=NAME without +"
    return None


def override_outside_global(text: str, at: str) -> str | None:
    """`override /model: tiny` in the defaults of a file whose keys land under its group (an
    experiment file without `# @package _global_`): hydra's "Could not override
    'model@experiment.model'" named no fix. None for another error."""
    got = re.search(r"Could not override '(\w+)@(\w+)\.\1'", text)
    if got is None:
        return None
    group, package = got.groups()
    fix = (
        "make `# @package _global_` its first line"
        if GROUP_PACKAGE.get(package) == "_global_"
        else "only an experiment file (`# @package _global_`) picks other groups: move it there"
    )
    return f"override /{group}: a default that picks another group{at}, read under {package}; {fix}"
