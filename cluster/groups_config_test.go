package cluster

import (
	"strings"
	"testing"
)

func TestClusterConfigPathPrefix(t *testing.T) {
	for _, tc := range []struct {
		prefix string
		want   string // the defaulted prefix; "" when refused
	}{
		{"", "/cluster"},
		{"/cluster", "/cluster"},
		{"/cluster/g2", "/cluster/g2"},
		{"/x", "/x"},
		{"/", ""},
		{"cluster", ""},
		{"/cluster/", ""},
		{"/cluster/g 1", ""},
		{"/cluster/g\t1", ""},
		{"/cluster//g1", ""},
		{"/cluster/./g1", ""},
		{"/cluster/../g1", ""},
		{"/cluster/{g}", ""},
		{"/cluster/g1?x", ""},
		{"/cluster/g1#x", ""},
		{"/cluster/g%31", ""},
	} {
		t.Run(tc.prefix, func(t *testing.T) {
			c, err := Config{NodeID: "a", RaftAddr: "127.0.0.1:7000", DataDir: "d", PathPrefix: tc.prefix}.withDefaults()
			switch {
			case tc.want == "" && err == nil:
				t.Fatalf("prefix %q accepted", tc.prefix)
			case tc.want == "" && !strings.Contains(err.Error(), "path prefix"):
				t.Fatalf("prefix %q: error %v does not name the prefix", tc.prefix, err)
			case tc.want != "" && err != nil:
				t.Fatalf("prefix %q: %v", tc.prefix, err)
			case tc.want != "" && c.PathPrefix != tc.want:
				t.Fatalf("prefix %q became %q, want %q", tc.prefix, c.PathPrefix, tc.want)
			}
		})
	}
}
