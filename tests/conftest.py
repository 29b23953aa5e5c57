"""Keeps the default run inside CI's 15 minutes on a 2-core machine. The cases below repeat, at a
larger world or on torch's gloo, what a default case already checks on our own path; they run
with ``pytest -m slow`` (the whole list is in each one's node id). The tests that make network
namespaces share one xdist group (``_NETNS``). The fault, stranger and mismatch programs run on
numpy buffers (their ranks skip torch's import: ~2 s a job instead of 5-12 s), so the default-mode
strangers, the forgery that gets in without authentication, another job's secret and the op and
skipped-call mismatches are back in the default run."""
import pytest

REPEATS = {
    # gloo is torch's: our adapter is covered at worlds 1-2; ours at 1-4
    "tests/multirank/test_matrix.py::test_matrix[3-gloo]",
    "tests/multirank/test_matrix.py::test_matrix[4-gloo]",
    "tests/multirank/test_quant.py::test_quantized_collectives_within_bound[3-gloo]",
    "tests/multirank/test_quant.py::test_quantized_collectives_within_bound[4-gloo]",
    "tests/multirank/test_reinit.py::test_reinit_on_the_same_port[gloo-rank0_first]",
    "tests/multirank/test_reinit.py::test_reinit_on_the_same_port[gloo-others_first]",
    "tests/multirank/test_multihost.py::test_collective_matrix_across_two_namespaces[gloo]",
    "tests/multirank/test_features.py::test_features[4-gloo]",
    # the ring's piece pipeline is also cut small in test_hierarchical's (2, 2) case
    "tests/multirank/test_matrix.py::test_matrix_tiny_pipeline_pieces",
    "tests/multirank/test_hierarchical.py::test_hierarchical_matrix_equals_the_reference_on_every_rank[3-2-16384]",
    # a lost peer at 3 ranks: sigkill and sigstop stay in the default run, the other exits at 2
    "tests/multirank/test_faults.py::test_survivors_name_the_lost_rank[exit0-3-tcp]",
    "tests/multirank/test_faults.py::test_survivors_name_the_lost_rank[exit1-3-tcp]",
    "tests/multirank/test_faults.py::test_survivors_name_the_lost_rank[abort-3-tcp]",
    "tests/multirank/test_faults.py::test_survivors_name_the_lost_rank[sigterm-3-tcp]",
    # quantized collectives at 4 ranks: 1-3 stay (and the 2x2 two-hop in test_quant_hier)
    "tests/multirank/test_quant.py::test_quantized_collectives_within_bound[4-zmq]",
    # CI took 896 s of its 900 with the 2026-11-27 review's tests (a quiet run of the default
    # multirank tests: 748 s); each of these repeats a default case at another size or backend:
    "tests/multirank/test_matrix.py::test_matrix[4-zmq]",  # 1-3 stay; 4 ranks in test_hybrid, test_features
    "tests/multirank/test_features.py::test_features[4-zmq]",  # 1-2 stay
    "tests/multirank/test_train.py::test_training_layers_equal_single_process[zmq-4]",  # 1-3 and gloo 2 stay
    "tests/multirank/test_hybrid.py::test_overlap_step_over_gloo",  # the same check over ours stays
    "tests/multirank/test_hierarchical.py::test_byte_counters_follow_the_formulas[3-2]",  # 2 x 2 stays
    "tests/multirank/test_hierarchical.py::test_topology_getters_and_mesh[2-2]",  # slow too (below): the topology unit tests stay
    "tests/multirank/test_pipeline.py::test_schedules_train_like_a_single_process[zmq-2]",  # zmq 3, gloo 2 stay
    # shm's freeze and test_frozen_peer's stay
    "tests/multirank/test_faults.py::test_survivors_name_the_lost_rank[sigstop-3-tcp]",
    "tests/multirank/test_ps.py::test_async_and_ssp_converge_within_the_bound[async-extra0]",  # SSP's bound stays
    "tests/multirank/test_reinit.py::test_reinit_on_the_same_port[zmq-rank0_first]",  # the two other orders stay
    "tests/multirank/test_launcher.py::test_bench_under_torchrun_measures_that_cluster",  # torchrun launch stays
    # test_bench_train counts a step's bytes per strategy
    "tests/multirank/test_launcher.py::test_train_lm_bytes_per_step_do_not_depend_on_the_step_count",
    # CI on a slower 2-core machine (2026-11-28: every rank's torch import 3-4 s, the default
    # multirank + docs run 1479 s, the whole CI 29 min): each of these repeats what a default
    # case checks at another size, backend or stranger, or runs a scenario a unit test covers
    # 16 ranks on 2 cores; 4 numpy ranks in test_lean_scale and 3-4 torch ranks elsewhere stay
    "tests/multirank/test_scale.py::test_sixteen_ranks",
    # test_replica_train_lm's node death stays
    "tests/multirank/test_replica_ft_emulated.py::test_a_node_dies_at_a_random_step_and_rejoins[1]",
    "tests/multirank/test_ps.py::test_kill_and_resume_ends_like_an_uninterrupted_run",  # test_ps_faults' resume cases stay
    # the 2 x 2 shaping and the CLI cluster stay
    "tests/multirank/test_emulated.py::test_auto_sharding_measures_the_links_and_uses_the_node_when_across_is_slow",
    "tests/multirank/test_emulated.py::test_estimate_measure_times_the_links_of_the_job_it_runs_in",
    "tests/multirank/test_emulated.py::test_bench_prints_intra_and_inter_node_bytes_flat_and_hierarchical",
    "tests/multirank/test_emulated.py::test_without_torchrun_variables_the_nodes_come_from_the_hosts",
    # test_hierarchical's matrix crosses nodes; the bind tests stay
    "tests/multirank/test_multihost.py::test_collective_matrix_across_two_namespaces[zmq]",
    "tests/multirank/test_multihost.py::test_parameter_server_job_across_two_namespaces",
    "tests/multirank/test_estimate.py::test_predicted_bytes_and_memory_equal_train_lm",  # its unit tests stay
    "tests/multirank/test_quant_hier.py::test_bench_quant_columns_beside_the_exact_op",  # the two-hop route test stays
    "tests/multirank/test_train.py::test_training_layers_equal_single_process[zmq-3]",  # zmq 1-2 and gloo 2 stay
    "tests/multirank/test_matrix.py::test_matrix[3-zmq]",  # 1-2 stay; 3 ranks in test_shm_p2p, test_anysource, test_pipeline
    # the 2-stage cases stay (zmq 3 in the schedules test)
    "tests/multirank/test_pipeline.py::test_1f1b_keeps_at_most_num_stages_micro_batches_in_flight_and_gpipe_all[3]",
    "tests/multirank/test_pipeline.py::test_pipedream_equals_the_2bw_rule_only_with_weight_stashing[3]",
    "tests/multirank/test_pipeline.py::test_tensor_lists_of_unknown_shape_and_batch_isend_irecv[zmq-3]",
    "tests/multirank/test_pipeline.py::test_tensor_lists_of_unknown_shape_and_batch_isend_irecv[gloo-2]",
    "tests/multirank/test_pipeline.py::test_a_dead_stage_is_peer_lost_naming_it_on_the_others[gloo]",  # the zmq case stays
    "tests/multirank/test_pipeline.py::test_micro_batch_shapes_that_change_between_steps_train_like_a_single_process[gloo]",
    "tests/multirank/test_pipeline.py::test_schedules_train_like_a_single_process[gloo-2]",
    "tests/multirank/test_ps.py::test_sync_equals_single_process[lamb-2-3]",  # sgd 1-2 and adamw 2-3 stay
    "tests/multirank/test_ps.py::test_sync_equals_single_process[sgd-2-3]",
    "tests/multirank/test_ps.py::test_bench_ps_prints_a_checked_table_and_json",  # bench ps' option checks are unit tests
    "tests/multirank/test_ps.py::test_dead_worker_can_be_left_behind",  # the sync-mode dead worker stays
    # ssp and the rejoin stay
    "tests/multirank/test_ps_join.py::test_a_worker_started_after_n_steps_joins_at_the_running_step_with_the_current_weights[async]",
    # other_rank, raw_tcp, silent_tcp and the CURVE job tests stay
    "tests/multirank/test_security.py::test_strangers_are_refused[plaintext]",
    "tests/multirank/test_security.py::test_strangers_are_refused[unknown_key]",
    # four other mismatches stay
    "tests/multirank/test_misuse.py::test_reduce_op_and_root_mismatch_is_named[all_to_all_more_pieces]",
    "tests/multirank/test_misuse.py::test_reduce_op_and_root_mismatch_is_named[reduce_max]",
    "tests/multirank/test_misuse.py::test_reduce_op_and_root_mismatch_is_named[reduce_scatter_min]",
    "tests/multirank/test_misuse.py::test_reduce_op_and_root_mismatch_is_named[avg_vs_sum_ring]",
    "tests/multirank/test_misuse.py::test_misuse[destroyed-gloo]",  # the zmq cases stay
    "tests/multirank/test_misuse.py::test_misuse[grad-gloo]",
    "tests/multirank/test_misuse.py::test_misuse[tags-gloo]",
    # sigkill at 2 over TCP and at 3 over shm stay
    "tests/multirank/test_faults.py::test_survivors_name_the_lost_rank[sigkill-3-tcp]",
    "tests/multirank/test_anysource.py::test_every_senders_messages_arrive_once_in_order[3-gloo-tcp]",  # zmq over shm stays
    "tests/multirank/test_anysource.py::test_every_senders_messages_arrive_once_in_order[3-zmq-tcp]",
    # the dead rank through torch stays
    "tests/multirank/test_tdist.py::test_torch_monitored_barrier_names_absent_ranks_as_on_gloo",
    # the resume from a checkpoint stays
    "tests/multirank/test_launcher.py::test_max_restarts_keeps_the_parameter_servers_running",
    # workers.train_lm and servers.ps stay
    "tests/multirank/test_launcher.py::test_entry_folders_still_run_from_the_repository_root[workers.allreduce_check]",
    "tests/multirank/test_launcher.py::test_entry_folders_still_run_from_the_repository_root[workers.ps_train]",
    # the codec's unit tests cover the options
    "tests/multirank/test_quant.py::test_small_blocks_fp16_scales_stochastic_rounding",
    "tests/multirank/test_quant.py::test_quantized_collectives_within_bound[3-zmq]",  # 1-2 stay
    "tests/multirank/test_quant.py::test_quantized_collectives_within_bound[1-gloo]",
    "tests/multirank/test_quant.py::test_quantized_collectives_within_bound[2-gloo]",
    "tests/multirank/test_quant_device.py::test_torch_codec_path_matches_numpy_path_bit_for_bit[3]",  # 2 stays
    "tests/multirank/test_quant_api.py::test_standard_calls_take_quant[gloo]",  # zmq stays
    "tests/multirank/test_deploy.py::test_slurm_sbatch_runs_a_parameter_server_job",  # the hosts launcher over ssh stays
    "tests/multirank/test_shm.py::test_every_collective_matches_the_reference[3]",  # 2 stays; 3 ranks on shm in test_shm_p2p
    "tests/multirank/test_reinit.py::test_reinit_on_the_same_port[gloo-together]",  # zmq together stays
    "tests/multirank/test_reinit.py::test_reinit_on_the_same_port[zmq-others_first]",
    # second round (CI 1236 s after the first): scenarios a default case or unit test also covers
    # the composition alone (its parts, the schedules and DataParallel, keep their default tests)
    "tests/multirank/test_pipeline.py::test_pipeline_by_data_parallel_trains_like_a_single_process",
    # the rejoin of a killed worker stays
    "tests/multirank/test_ps_join.py::test_a_worker_started_after_n_steps_joins_at_the_running_step_with_the_current_weights[ssp]",
    "tests/multirank/test_hierarchical.py::test_topology_getters_and_mesh[3-2]",  # the topology's unit tests stay
    "tests/multirank/test_launcher.py::test_bench_json_is_complete",  # the bench report's unit tests stay
    # the all_to_all lengths on shared memory stay
    "tests/multirank/test_misuse.py::test_reduce_op_and_root_mismatch_is_named[all_to_all_lengths]",
    "tests/multirank/test_misuse.py::test_reduce_op_and_root_mismatch_is_named[max_vs_sum]",
    "tests/multirank/test_matrix.py::test_matrix[1-gloo]",  # gloo at 2 stays
    "tests/multirank/test_features.py::test_features[1-gloo]",
    "tests/multirank/test_store_proxy.py::test_rank_0s_store_serves_one_connection_per_node[true-4-secret]",
}


# The README's command runs the suite on two pytest-xdist workers (`-n 2 --dist loadgroup`). These
# files make network namespaces (the emulated cluster binds 29500 inside them and lists
# namespaces to check it left none): one worker runs them all, one after another.
_NETNS = ("test_emulated", "test_multihost", "test_replica_ft_emulated", "test_replica_train_lm", "test_deploy",
          "test_elastic", "test_estimate", "test_readme")


# pyproject's 120 s per test bounds a hang; a multi-rank test is bounded by its launch's deadline
# (run_ranks' timeout_s) and some take 40-65 s on two busy cores (quantized training, HYBRID_SHARD):
# on a machine twice as slow 120 s would fail them, not a hang. Those without their own get this.
MULTIRANK_TIMEOUT_S = 300


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid in REPEATS:
            item.add_marker(pytest.mark.slow)
        if any(f"/{name}.py" in str(item.fspath) for name in _NETNS):
            item.add_marker(pytest.mark.xdist_group("netns"))
        if "/tests/multirank/" in str(item.fspath) and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(MULTIRANK_TIMEOUT_S))
    if getattr(config.option, "loadgroup", False):  # an xdist worker under --dist loadgroup
        _group_ids(items)


def _group_ids(items) -> None:
    """What pytest-xdist's loadgroup does to the node id of a test marked ``xdist_group`` (it
    appends ``@<group>``, and the controller sends a group's tests to one worker), where xdist's
    own hook no longer can: it sets ``item._nodeid``, which pytest 9 does not read (the id lives
    in ``item._id``), so every group was spread over both workers, the netns tests above and the
    tests sharing one launch through a module fixture alike (test_hybrid, test_hierarchical,
    test_pipeline: each launch ran on both). Does nothing where xdist's hook worked."""
    for item in items:
        names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                        for m in item.iter_markers("xdist_group")})
        suffix = "@" + "_".join(names)
        if names and not item.nodeid.endswith(suffix) and hasattr(item, "_id"):
            try:
                from _pytest.nodeid import NodeId  # pytest 9's; an older pytest reads _nodeid (xdist's)
            except ImportError:
                return
            item._id = NodeId.parse(item.nodeid + suffix)

