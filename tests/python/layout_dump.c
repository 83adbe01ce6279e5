/* Prints the size and field offsets of every struct in factorps/client.h,
 * one "struct field offset" line each (field "-" is the struct's size).
 * test_layout.py compares them with the ctypes mirror in
 * client/python/factorps/_lib.py, so the binding cannot silently drift
 * from the header. */
#include <stddef.h>
#include <stdio.h>

#include "factorps/client.h"

#define SIZE(T) printf("%s - %zu\n", #T, sizeof(T))
#define FIELD(T, f) printf("%s %s %zu\n", #T, #f, offsetof(T, f))

int main(void) {
  SIZE(fps_status_t);
  FIELD(fps_status_t, code);
  FIELD(fps_status_t, shard);
  FIELD(fps_status_t, message);

  SIZE(fps_client_options_t);
  FIELD(fps_client_options_t, deadline_seconds);
  FIELD(fps_client_options_t, max_retries);
  FIELD(fps_client_options_t, backoff_initial_seconds);
  FIELD(fps_client_options_t, max_message_bytes);
  FIELD(fps_client_options_t, tls_ca_file);
  FIELD(fps_client_options_t, tls_cert_file);
  FIELD(fps_client_options_t, tls_key_file);
  FIELD(fps_client_options_t, auth_token);
  FIELD(fps_client_options_t, tls_server_name);
  FIELD(fps_client_options_t, wire_dtype);
  FIELD(fps_client_options_t, split_min_bytes);
  FIELD(fps_client_options_t, push_chunk_bytes);
  FIELD(fps_client_options_t, job_id);

  SIZE(fps_optim_config_t);
  FIELD(fps_optim_config_t, flavor);
  FIELD(fps_optim_config_t, has_lr);
  FIELD(fps_optim_config_t, lr);
  FIELD(fps_optim_config_t, has_beta2_decay);
  FIELD(fps_optim_config_t, beta2_decay);
  FIELD(fps_optim_config_t, has_eps1);
  FIELD(fps_optim_config_t, eps1);
  FIELD(fps_optim_config_t, has_eps2);
  FIELD(fps_optim_config_t, eps2);
  FIELD(fps_optim_config_t, has_clip_threshold);
  FIELD(fps_optim_config_t, clip_threshold);
  FIELD(fps_optim_config_t, has_weight_decay);
  FIELD(fps_optim_config_t, weight_decay);
  FIELD(fps_optim_config_t, has_maximize);
  FIELD(fps_optim_config_t, maximize);
  FIELD(fps_optim_config_t, has_relative_step);
  FIELD(fps_optim_config_t, relative_step);
  FIELD(fps_optim_config_t, has_scale_parameter);
  FIELD(fps_optim_config_t, scale_parameter);
  FIELD(fps_optim_config_t, has_warmup_init);
  FIELD(fps_optim_config_t, warmup_init);
  FIELD(fps_optim_config_t, has_beta1);
  FIELD(fps_optim_config_t, beta1);

  SIZE(fps_tensor_def_t);
  FIELD(fps_tensor_def_t, name);
  FIELD(fps_tensor_def_t, ndim);
  FIELD(fps_tensor_def_t, shape);
  FIELD(fps_tensor_def_t, optim);
  FIELD(fps_tensor_def_t, init);
  FIELD(fps_tensor_def_t, step);
  FIELD(fps_tensor_def_t, state_row);
  FIELD(fps_tensor_def_t, state_col);
  FIELD(fps_tensor_def_t, state_var);
  FIELD(fps_tensor_def_t, state_mom);
  FIELD(fps_tensor_def_t, rms);
  FIELD(fps_tensor_def_t, replace);

  SIZE(fps_shard_stats_t);
  FIELD(fps_shard_stats_t, shard_id);
  FIELD(fps_shard_stats_t, shard_count);
  FIELD(fps_shard_stats_t, mode);
  FIELD(fps_shard_stats_t, simd);
  FIELD(fps_shard_stats_t, tensors);
  FIELD(fps_shard_stats_t, param_elements);
  FIELD(fps_shard_stats_t, param_bytes);
  FIELD(fps_shard_stats_t, state_row);
  FIELD(fps_shard_stats_t, state_col);
  FIELD(fps_shard_stats_t, state_var);
  FIELD(fps_shard_stats_t, state_mom);
  FIELD(fps_shard_stats_t, state_elements);
  FIELD(fps_shard_stats_t, state_bytes);
  FIELD(fps_shard_stats_t, adamw_elements);
  FIELD(fps_shard_stats_t, adamw_bytes);
  FIELD(fps_shard_stats_t, pushes);
  FIELD(fps_shard_stats_t, push_errors);
  FIELD(fps_shard_stats_t, updates);
  FIELD(fps_shard_stats_t, bytes_received);
  FIELD(fps_shard_stats_t, bytes_sent);
  FIELD(fps_shard_stats_t, push_seconds_sum);
  FIELD(fps_shard_stats_t, push_seconds_p50);
  FIELD(fps_shard_stats_t, push_seconds_p99);
  FIELD(fps_shard_stats_t, update_seconds_sum);
  FIELD(fps_shard_stats_t, update_bytes);
  FIELD(fps_shard_stats_t, uptime_seconds);
  FIELD(fps_shard_stats_t, workers);
  FIELD(fps_shard_stats_t, staleness);
  FIELD(fps_shard_stats_t, version);
  FIELD(fps_shard_stats_t, split_blocks);
  FIELD(fps_shard_stats_t, split_param_bytes);
  FIELD(fps_shard_stats_t, exchange_sent_bytes);
  FIELD(fps_shard_stats_t, exchange_received_bytes);
  FIELD(fps_shard_stats_t, exchange_steps);
  FIELD(fps_shard_stats_t, exchange_failures);
  FIELD(fps_shard_stats_t, exchange_seconds_sum);
  FIELD(fps_shard_stats_t, replica_role);
  FIELD(fps_shard_stats_t, term);
  FIELD(fps_shard_stats_t, replica_peer);
  FIELD(fps_shard_stats_t, standby_joined);
  FIELD(fps_shard_stats_t, replica);
  FIELD(fps_shard_stats_t, state_checksum);

  SIZE(fps_apply_record_t);
  FIELD(fps_apply_record_t, worker_id);
  FIELD(fps_apply_record_t, step);
  FIELD(fps_apply_record_t, version);
  FIELD(fps_apply_record_t, lr);
  FIELD(fps_apply_record_t, weight_decay);

  SIZE(fps_tensor_push_t);
  FIELD(fps_tensor_push_t, has_lr);
  FIELD(fps_tensor_push_t, lr);
  FIELD(fps_tensor_push_t, has_weight_decay);
  FIELD(fps_tensor_push_t, weight_decay);
  FIELD(fps_tensor_push_t, no_grad);
  FIELD(fps_tensor_push_t, has_step);
  FIELD(fps_tensor_push_t, step);
  FIELD(fps_tensor_push_t, skip_step);

  SIZE(fps_tensor_state_t);
  FIELD(fps_tensor_state_t, version);
  FIELD(fps_tensor_state_t, step);
  FIELD(fps_tensor_state_t, rms);
  FIELD(fps_tensor_state_t, lr);
  FIELD(fps_tensor_state_t, weight_decay);
  FIELD(fps_tensor_state_t, row_elements);
  FIELD(fps_tensor_state_t, col_elements);
  FIELD(fps_tensor_state_t, var_elements);
  FIELD(fps_tensor_state_t, mom_elements);

  SIZE(fps_push_args_t);
  FIELD(fps_push_args_t, worker_id);
  FIELD(fps_push_args_t, num_workers);
  FIELD(fps_push_args_t, step);
  FIELD(fps_push_args_t, expect_mode);
  FIELD(fps_push_args_t, push_id);

  SIZE(fps_tensor_stats_t);
  FIELD(fps_tensor_stats_t, name);
  FIELD(fps_tensor_stats_t, shard);
  FIELD(fps_tensor_stats_t, ndim);
  FIELD(fps_tensor_stats_t, shape);
  FIELD(fps_tensor_stats_t, version);
  FIELD(fps_tensor_stats_t, ready);
  FIELD(fps_tensor_stats_t, factored);
  FIELD(fps_tensor_stats_t, flavor);
  FIELD(fps_tensor_stats_t, param_elements);
  FIELD(fps_tensor_stats_t, param_bytes);
  FIELD(fps_tensor_stats_t, state_row);
  FIELD(fps_tensor_stats_t, state_col);
  FIELD(fps_tensor_stats_t, state_var);
  FIELD(fps_tensor_stats_t, state_mom);
  FIELD(fps_tensor_stats_t, state_elements);
  FIELD(fps_tensor_stats_t, state_bytes);
  FIELD(fps_tensor_stats_t, adamw_elements);
  FIELD(fps_tensor_stats_t, adamw_bytes);
  FIELD(fps_tensor_stats_t, block_index);
  FIELD(fps_tensor_stats_t, n_blocks);
  FIELD(fps_tensor_stats_t, row_lo);
  FIELD(fps_tensor_stats_t, row_hi);
  FIELD(fps_tensor_stats_t, checksum);

  SIZE(fps_block_t);
  FIELD(fps_block_t, tensor);
  FIELD(fps_block_t, shard);
  FIELD(fps_block_t, row_lo);
  FIELD(fps_block_t, row_hi);
  FIELD(fps_block_t, bytes);

  SIZE(fps_checkpoint_info_t);
  FIELD(fps_checkpoint_info_t, path);
  FIELD(fps_checkpoint_info_t, sequence);
  FIELD(fps_checkpoint_info_t, bytes);
  FIELD(fps_checkpoint_info_t, tensors);
  FIELD(fps_checkpoint_info_t, seconds);
  return 0;
}
