#!/usr/bin/env bash
# The main job: a real distributed DDP run (2 simulated nodes x 2 processes) on this machine.
set -euo pipefail
cd "$(dirname "$0")/.."
azulite job submit examples/ddp/job.yaml --wait
