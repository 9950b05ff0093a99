# The examples and benchmarks run as modules from the repository root (`python -m
# examples.llama.train`, `python -m benchmarks.bench`); this rewrites the older commands
# (`PYTHONPATH=. python examples/llama/train.py`) in docs/*.md, and tests/test_examples.py's
# tests in the files it was split into. From the repository root:
#   sed -E -i -f docs-commands.sed docs/*.md $(ls docs/results/*.md 2>/dev/null)
# Recorded outputs (docs/results/*.txt, *.json) keep the command as it was run.

# A command split after `PYTHONPATH=. \`: the variable goes, the continuation stays.
/PYTHONPATH=\. \\$/{
  N
  s/PYTHONPATH=\. \\\n([[:space:]]*python3? +(examples|benchmarks)\/)/\\\n\1/
}
# A command split after `python3`: the script on the next line.
/(^|[[:space:]])python3?[[:space:]]*$/{
  N
  s/(python3?)\n(examples|benchmarks)\/([A-Za-z0-9_]+)\/([A-Za-z0-9_]+)\.py([^A-Za-z0-9_]|$)/\1 -m\n\2.\3.\4\5/
  s/(python3?)\n(examples|benchmarks)\/([A-Za-z0-9_]+)\.py([^A-Za-z0-9_]|$)/\1 -m\n\2.\3\4/
}

# `python examples/llama/train.py` -> `python -m examples.llama.train` (two levels, then one).
s/(python3?) +(\.\/)?(examples|benchmarks)\/([A-Za-z0-9_]+)\/([A-Za-z0-9_]+)\.py([^A-Za-z0-9_]|$)/\1 -m \3.\4.\5\6/g
s/(python3?) +(\.\/)?(examples|benchmarks)\/([A-Za-z0-9_]+)\.py([^A-Za-z0-9_]|$)/\1 -m \3.\4\5/g
# `PYTHONPATH=.` before such a command (other variables between kept): -m finds the root.
s/PYTHONPATH=\. +(([A-Z_]+=[^ ]* +)*python3? -m (examples|benchmarks)\.)/\1/g
s/PYTHONPATH=\. +(python3? -m\n(examples|benchmarks)\.)/\1/

# docs/llama.md: the package's place on the path, and its NNX block's import of model.py.
s/^`examples\/llama\/` is a package \(`llama`\) of one module per concern; `train\.py` puts$/`examples\/llama\/` is a package (`examples.llama`) of one module per concern, beside/
s/^`examples\/` on the path \(where `common\.py` and `vocabulary\.py`, shared with `train_gpt\.py`,$/`examples\/common.py` and `examples\/vocabulary.py` (shared with `train_gpt.py`); it runs from/
s/^live\), so `python examples\/llama\/train\.py` runs from any directory\. To reuse a piece, put$/the repository root as `python -m examples.llama.train`. To reuse a piece, import it from/
s/^live\), so `python -m examples\.llama\.train` runs from any directory\. To reuse a piece, put$/the repository root as `python -m examples.llama.train`. To reuse a piece, import it from/
s/^`examples\/` on the path too: `from llama\.layers import split`\.$/the root: `from examples.llama.layers import split`./
/^import sys$/{
  N
  s/^import sys\nimport jax, jax\.numpy as jnp, optax$/import jax, jax.numpy as jnp, optax/
}
/^sys\.path\.insert\(0, "examples\/llama"\) +# from the repository's root$/d
s/^from model import Config, Llama( +)# examples\/llama\/model\.py: no jaxgraph in it$/from examples.llama.model import Config, Llama  # from the repository's root; no jaxgraph in it/

# docs/performance.md: how the scripts run.
s/^Every script runs from the repository root with `PYTHONPATH=\.`;$/Every script runs from the repository root as a module (`python -m benchmarks.NAME`);/

# tests/test_examples.py, split by concern: a test named with its file goes to its new file;
# a file named alone, by what the line says of it.
s/test_examples\.py::test_corrupt_latest_checkpoint_is_named_and_the_previous_restored\b/test_examples_checkpoints.py::test_corrupt_latest_checkpoint_is_named_and_the_previous_restored/g
s/test_examples\.py::test_a_history_that_does_not_fit_its_step_is_rejected\b/test_examples_checkpoints.py::test_a_history_that_does_not_fit_its_step_is_rejected/g
s/test_examples\.py::test_the_newest_checkpoints_are_kept_as_asked\b/test_examples_checkpoints.py::test_the_newest_checkpoints_are_kept_as_asked/g
s/test_examples\.py::test_no_intact_checkpoint_is_one_error\b/test_examples_checkpoints.py::test_no_intact_checkpoint_is_one_error/g
s/test_examples\.py::test_metrics_json_is_written_atomically\b/test_examples_checkpoints.py::test_metrics_json_is_written_atomically/g
s/test_examples\.py::test_llama_flags_are_checked_first\b/test_examples_checkpoints.py::test_llama_flags_are_checked_first/g
s/test_examples\.py::test_llama_resume_checks_the_checkpoints_step_and_config\b/test_examples_checkpoints.py::test_llama_resume_checks_the_checkpoints_step_and_config/g
s/test_examples\.py::test_llama_resume_reads_verified_metadata_and_stops_a_finished_run_first\b/test_examples_checkpoints.py::test_llama_resume_reads_verified_metadata_and_stops_a_finished_run_first/g
s/test_examples\.py::test_a_resume_of_a_model_of_other_shapes_is_one_message\b/test_examples_checkpoints.py::test_a_resume_of_a_model_of_other_shapes_is_one_message/g
s/test_examples\.py::test_llama_resume_refuses_another_vocabulary\b/test_examples_checkpoints.py::test_llama_resume_refuses_another_vocabulary/g
s/test_examples\.py::test_llama_fsdp_shards_the_state_and_matches_the_whole_step\b/test_examples_fsdp.py::test_llama_fsdp_shards_the_state_and_matches_the_whole_step/g
s/test_examples\.py::test_llama_fsdp_resumes_bitwise\b/test_examples_fsdp.py::test_llama_fsdp_resumes_bitwise/g
s/test_examples\.py::test_llama_fsdp_two_processes_agree_with_one\b/test_examples_fsdp.py::test_llama_fsdp_two_processes_agree_with_one/g
s/test_examples\.py::test_llama_fsdp_prefetch_hands_collectives_across_blocks\b/test_examples_fsdp.py::test_llama_fsdp_prefetch_hands_collectives_across_blocks/g
s/test_examples\.py::test_llama_step_sums_its_grads_in_fewer_calls_bitwise\b/test_examples_llama.py::test_llama_step_sums_its_grads_in_fewer_calls_bitwise/g
s/test_examples\.py::test_llama_kv_cache_decode_matches_the_full_forward\b/test_examples_llama.py::test_llama_kv_cache_decode_matches_the_full_forward/g
s/test_examples\.py::test_llama_sets_the_gpu_memory_fraction_unless_given\b/test_examples_llama.py::test_llama_sets_the_gpu_memory_fraction_unless_given/g
s/test_examples\.py::test_llama_offload_spellings\b/test_examples_llama.py::test_llama_offload_spellings/g
s/test_examples\.py::test_gpu_presets_time_steady_state_and_gpu_1b_fits_80gb\b/test_examples_llama.py::test_gpu_presets_time_steady_state_and_gpu_1b_fits_80gb/g
s/test_examples\.py::test_an_earlier_run_is_refused_and_fresh_moves_it_aside\b/test_examples_runs.py::test_an_earlier_run_is_refused_and_fresh_moves_it_aside/g
s/test_examples\.py::test_out_is_checked_before_anything_is_built\b/test_examples_runs.py::test_out_is_checked_before_anything_is_built/g
s/test_examples\.py::test_a_failed_save_ends_in_one_message_naming_the_last_step_saved\b/test_examples_runs.py::test_a_failed_save_ends_in_one_message_naming_the_last_step_saved/g
s/test_examples\.py::test_a_full_disk_writing_metrics_ends_in_one_message\b/test_examples_runs.py::test_a_full_disk_writing_metrics_ends_in_one_message/g
s/test_examples\.py::test_a_full_disk_during_a_save_prints_one_message_and_nothing_else\b/test_examples_runs.py::test_a_full_disk_during_a_save_prints_one_message_and_nothing_else/g
s/test_examples\.py::test_llama_on_a_full_disk_ends_in_one_message\b/test_examples_runs.py::test_llama_on_a_full_disk_ends_in_one_message/g
s/test_examples\.py::test_closed_event_loop_callbacks_are_dropped_and_other_unraisables_kept\b/test_examples_runs.py::test_closed_event_loop_callbacks_are_dropped_and_other_unraisables_kept/g
s/test_examples\.py::test_ctrl_c_inside_a_write_waits_for_it\b/test_examples_runs.py::test_ctrl_c_inside_a_write_waits_for_it/g
s/test_examples\.py::test_resume_command_continues_the_run\b/test_examples_runs.py::test_resume_command_continues_the_run/g
s/test_examples\.py::test_documented_commands_run_in_order_meet_no_earlier_run\b/test_examples_runs.py::test_documented_commands_run_in_order_meet_no_earlier_run/g
s/test_examples\.py::test_examples_share_one_progress_bar\b/test_examples_runs.py::test_examples_share_one_progress_bar/g
s/test_examples\.py::test_train_gpt_trains_checkpoints_and_resumes_bitwise\b/test_examples_training.py::test_train_gpt_trains_checkpoints_and_resumes_bitwise/g
s/test_examples\.py::test_llama_trains_matches_whole_step_resumes_bitwise_and_decodes\b/test_examples_training.py::test_llama_trains_matches_whole_step_resumes_bitwise_and_decodes/g
s/test_examples\.py::test_llama_flat_params_train_match_whole_step_and_resume_bitwise\b/test_examples_training.py::test_llama_flat_params_train_match_whole_step_and_resume_bitwise/g
s/test_examples\.py::test_llama_plain_ends_untied_without_dropout_subwords_offloaded\b/test_examples_training.py::test_llama_plain_ends_untied_without_dropout_subwords_offloaded/g
s/test_examples\.py::test_llama_lora_fine_tunes_a_trained_run\b/test_examples_training.py::test_llama_lora_fine_tunes_a_trained_run/g
s/test_examples\.py::test_llama_lora_and_init_from_flags_are_checked_first\b/test_examples_training.py::test_llama_lora_and_init_from_flags_are_checked_first/g
s/test_examples\.py::test_llama_tiny_preset_computes_the_golden_numbers\b/test_examples_training.py::test_llama_tiny_preset_computes_the_golden_numbers/g
s/test_examples\.py::test_llama_resumes_a_checkpoint_written_before_the_split_through_ctrl_c\b/test_examples_training.py::test_llama_resumes_a_checkpoint_written_before_the_split_through_ctrl_c/g
s/test_examples\.py::test_linen_mlp_trains\b/test_examples_training.py::test_linen_mlp_trains/g
s/test_examples\.py::test_subword_vocabulary_round_trips_and_is_trained_once\b/test_examples_vocabulary.py::test_subword_vocabulary_round_trips_and_is_trained_once/g
s/test_examples\.py::test_python_stdlib_text_is_the_standard_librarys_sources\b/test_examples_vocabulary.py::test_python_stdlib_text_is_the_standard_librarys_sources/g
/FSDP_GROUP|--fsdp|2 x 4/s/test_examples\.py/test_examples_fsdp.py/g
/checks the count and that it fits/s/test_examples\.py/test_examples_llama.py/g
/the test that holds it/s/tests\/test_examples\.py/tests\/test_examples_*.py/g
s/test_examples\.py/test_examples_training.py/g
