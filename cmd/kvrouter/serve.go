package main

import (
	"context"
	"fmt"
	"io"
)

// runServe will compose the cluster, event bus and API; until those land it
// says so instead of pretending.
func runServe(_ context.Context, _ []string, _, stderr io.Writer) int {
	fmt.Fprintln(stderr, "kvrouter serve: not built yet (cluster, event bus and API are in progress)")
	return 2
}
