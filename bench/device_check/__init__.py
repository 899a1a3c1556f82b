"""The device check (issue 32): exactness, the 7B geometry's steps, a fitted device profile
and a real cell beside its simulation, on one accelerator, in one prepared command
(`python -m bench.device_check OUT`, `make device-check`); see __main__.py for the stages
and plan.py for their sizes and time limits."""
