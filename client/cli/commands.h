/* Subcommands of the `factorps` command-line tool. Each takes the arguments
 * after its own name (argv[0] is the subcommand name) and returns the
 * process exit status. */
#ifndef FPS_CLI_COMMANDS_H
#define FPS_CLI_COMMANDS_H

int fps_cli_replay(int argc, char **argv);

#endif
