/* factorps: the command-line tool. Dispatches to one subcommand. */
#include <stdio.h>
#include <string.h>

#include "commands.h"

typedef struct fps_cli_command_s {
  const char *name;
  int (*run)(int argc, char **argv);
  const char *summary;
} fps_cli_command_t;

static const fps_cli_command_t commands[] = {
#ifdef FPS_CLI_HAVE_REPLAY
    {"replay", fps_cli_replay, "replay Adafactor golden vectors through the kernels"},
#endif
    {"stats", fps_cli_stats, "print the figures of every shard (--json for machines)"},
    {"pull", fps_cli_pull, "print or save the current values of tensors"},
    {"load", fps_cli_load, "synthetic training load: W workers push S steps of N parameters"},
    {"checkpoint", fps_cli_checkpoint, "make every shard checkpoint now, verify a checkpoint directory, or reshard checkpoints"},
    {"plan", fps_cli_plan, "placement of a load model's tensors on S shards, with row splitting"},
};

static void usage(FILE *out) {
  fprintf(out, "usage: factorps <command> [options]   (factorps --version: the version)\n\n"
               "commands:\n");
  for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
    fprintf(out, "  %-10s %s\n", commands[i].name, commands[i].summary);
  fprintf(out, "\n'factorps <command> --help' describes one command. Every command that talks\n"
               "to shards takes --shards HOST:PORT[,...], by default $FACTORPS_SHARDS; a shard\n"
               "with a standby is one entry listing both: PRIMARY:PORT|STANDBY:PORT.\n");
}

int main(int argc, char **argv) {
  if (argc < 2) {
    usage(stderr);
    return 2;
  }
  if (!strcmp(argv[1], "--version") || !strcmp(argv[1], "-V")) {
    printf("factorps %s\n", FPS_VERSION);
    return 0;
  }
  if (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
    usage(stdout);
    return 0;
  }
  for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
    if (!strcmp(argv[1], commands[i].name)) return commands[i].run(argc - 1, argv + 1);
  fprintf(stderr, "factorps: unknown command '%s'\n", argv[1]);
  usage(stderr);
  return 2;
}
