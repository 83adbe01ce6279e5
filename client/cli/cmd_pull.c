#include "commands.h"
int fps_cli_pull(int argc, char **argv) { (void)argc; (void)argv; return 1; }
