"""The course tools: build the course from solutions/, grade notebooks, the learner's workspace,
and the switch between the reference code and the learner's own (`zero-lab`, see docs/build.md).

The rest of zero_lab is the lab bench (launcher, ledgers, models, data, prepare) and the
modules the lessons export.
"""
