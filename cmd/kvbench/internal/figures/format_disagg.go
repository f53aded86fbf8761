package figures

import (
	"fmt"
	"strings"
)

// tableAfter returns the first Markdown table in text after the first line
// that starts with after ("" = from the top), and the line that follows
// the table's blank line when it starts with then ("" = none wanted).
func tableAfter(text, after, then string) (string, error) {
	ls := strings.Split(text, "\n")
	i := 0
	if after != "" {
		for i < len(ls) && !strings.HasPrefix(ls[i], after) {
			i++
		}
		if i == len(ls) {
			return "", fmt.Errorf("no line starting with %q in the output", after)
		}
	}
	for i < len(ls) && !strings.HasPrefix(ls[i], "|") {
		i++
	}
	j := i
	for j < len(ls) && strings.HasPrefix(ls[j], "|") {
		j++
	}
	if i == j {
		return "", fmt.Errorf("no table after %q in the output", after)
	}
	out := strings.Join(ls[i:j], "\n") + "\n"
	if then != "" {
		k := j
		for k < len(ls) && strings.TrimSpace(ls[k]) == "" {
			k++
		}
		if k == len(ls) || !strings.HasPrefix(ls[k], then) {
			return "", fmt.Errorf("no line starting with %q after the table", then)
		}
		out += "\n" + ls[k] + "\n"
	}
	return out, nil
}

// formatDisaggGrid: kvbench disagg's link × prompt table and its bound
// line, as the command prints them.
func formatDisaggGrid(out Output) (string, error) {
	return tableAfter(out.Stdout, "", "auto ≤")
}

// formatDisaggSeed001: kvbench disagg's seed 001 table, as printed.
func formatDisaggSeed001(out Output) (string, error) {
	return tableAfter(out.Stdout, "seed 001", "")
}
