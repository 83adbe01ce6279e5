/* Subcommands of the `factorps` command-line tool. Each takes the arguments
 * after its own name (argv[0] is the subcommand name) and returns the
 * process exit status: 0 success, 1 failure, 2 usage error. */
#ifndef FPS_CLI_COMMANDS_H
#define FPS_CLI_COMMANDS_H

#include <stddef.h>

int fps_cli_replay(int argc, char **argv);
int fps_cli_stats(int argc, char **argv);
int fps_cli_pull(int argc, char **argv);
int fps_cli_load(int argc, char **argv);
int fps_cli_checkpoint(int argc, char **argv);

/* Helpers shared by the subcommands (args.c). */

/* Splits "A,B,C" into a NULL-terminated array of copies; *n gets the count.
 * Returns NULL on an empty element or out of memory. Free with
 * fps_cli_split_free(). */
char **fps_cli_split(const char *list, size_t *n);
void fps_cli_split_free(char **v);
/* Strict number parsing; 0 on success, -1 (after printing `what`) on junk
 * or out of range. */
int fps_cli_u64(const char *s, const char *what, unsigned long long lo, unsigned long long hi,
                unsigned long long *out);
int fps_cli_double(const char *s, const char *what, double lo, double hi, double *out);
/* Parses a count with an optional k/M/G suffix (decimal: 10M = 10000000). */
int fps_cli_count(const char *s, const char *what, unsigned long long *out);

#endif
