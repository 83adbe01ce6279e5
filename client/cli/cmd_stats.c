#include "commands.h"
int fps_cli_stats(int argc, char **argv) { (void)argc; (void)argv; return 1; }
