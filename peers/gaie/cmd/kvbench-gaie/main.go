// Command kvbench-gaie is a peerpolicy peer: GAIE v1.3.0's scheduler with
// its default profile (package gaie), answering `kvbench sim`'s routing
// requests as JSON lines on stdin/stdout. kvbench starts it; it is not run
// by hand (`make build` puts it in bin/).
package main

import (
	"fmt"
	"os"

	"github.com/kvrouter/kvrouter/peers/gaie"
)

func main() {
	if len(os.Args) > 1 {
		fmt.Fprintf(os.Stderr, "%s: %s\ntakes no arguments: kvbench starts it and speaks JSON lines on its stdin and stdout (internal/peerpolicy)\n", os.Args[0], gaie.Name)
		os.Exit(2)
	}
	if err := gaie.Serve(os.Stdin, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "kvbench-gaie:", err)
		os.Exit(1)
	}
}
