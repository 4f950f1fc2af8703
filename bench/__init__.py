"""rlhf_lit's runner for the shared benchmark workload (../shared/bench); see bench/README.md."""
