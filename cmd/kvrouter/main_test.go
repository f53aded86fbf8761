package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
)

func TestCLIHash(t *testing.T) {
	tests := []struct {
		name   string
		args   []string
		code   int
		want   []string
		stderr string
	}{
		{"dynamo vectors", []string{"hash", "--block-size", "4", "1", "2", "3", "4", "5", "6", "7", "8", "9", "10", "11", "12"}, 0,
			[]string{"block=0 local=14643705804678351452 seq=14643705804678351452",
				"block=1 local=16777012769546811212 seq=4945711292740353085",
				"block=2 local=483935686894639516 seq=12583592247330656132"}, ""},
		{"lora", []string{"hash", "--block-size", "4", "--lora", "my-lora", "1", "2", "3", "4"}, 0,
			[]string{"local=15671544057904749233"}, ""},
		{"partial block", []string{"hash", "--block-size", "4", "1", "2"}, 0, nil, "trailing tokens"},
		{"bad token", []string{"hash", "--block-size", "4", "x"}, 2, nil, "not a u32"},
		{"negative token", []string{"hash", "-1"}, 2, nil, ""},
		{"zero block size", []string{"hash", "--block-size", "0", "1"}, 2, nil, "must be positive"},
		{"unknown command", []string{"frobnicate"}, 2, nil, "unknown command"},
	}
	for _, tc := range tests {
		var out, errb bytes.Buffer
		code := dispatch(context.Background(), tc.args, &out, &errb)
		if code != tc.code {
			t.Errorf("%s: exit %d, want %d (%s)", tc.name, code, tc.code, errb.String())
		}
		for _, w := range tc.want {
			if !strings.Contains(out.String(), w) {
				t.Errorf("%s: output lacks %q:\n%s", tc.name, w, out.String())
			}
		}
		if !strings.Contains(errb.String(), tc.stderr) {
			t.Errorf("%s: stderr %q lacks %q", tc.name, errb.String(), tc.stderr)
		}
	}
}
