package main

import (
	"errors"
	"testing"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/openai/openai-go/v3/responses"
)

// The official OpenAI Go client accepts kvmock's answers: the model list, a
// streamed chat, a plain chat with usage and a legacy completion (what
// /work/shared/acceptance/clients/openai-check does).
func TestMockOpenAIClient(t *testing.T) {
	tm := startMock(t, nil, false)
	ctx := t.Context()
	c := openai.NewClient(option.WithBaseURL(tm.url+"/v1/"), option.WithAPIKey("unused"), option.WithMaxRetries(0))

	models, err := c.Models.List(ctx)
	if err != nil || len(models.Data) != 1 || models.Data[0].ID != "kvmock" {
		t.Fatalf("models: %+v %v", models, err)
	}

	stream := c.Chat.Completions.NewStreaming(ctx, openai.ChatCompletionNewParams{
		Model:         "kvmock",
		Messages:      []openai.ChatCompletionMessageParamUnion{openai.SystemMessage("You are terse."), openai.UserMessage("Count to five.")},
		MaxTokens:     openai.Int(16),
		StreamOptions: openai.ChatCompletionStreamOptionsParam{IncludeUsage: openai.Bool(true)},
	})
	acc := openai.ChatCompletionAccumulator{}
	chunks := 0
	for stream.Next() {
		acc.AddChunk(stream.Current())
		chunks++
	}
	if err := stream.Err(); err != nil || chunks < 2 || len(acc.Choices) == 0 || acc.Choices[0].Message.Content == "" {
		t.Fatalf("streamed chat: err=%v chunks=%d", err, chunks)
	}
	if acc.Usage.CompletionTokens != 16 || acc.Choices[0].FinishReason != "stop" {
		t.Fatalf("streamed chat: usage %+v finish %q", acc.Usage, acc.Choices[0].FinishReason)
	}

	chat, err := c.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{
		Model:     "kvmock",
		Messages:  []openai.ChatCompletionMessageParamUnion{openai.UserMessage("Say hello.")},
		MaxTokens: openai.Int(8),
	})
	if err != nil || len(chat.Choices) == 0 || chat.Usage.PromptTokens == 0 || chat.Choices[0].Message.Content == "" {
		t.Fatalf("chat: %+v %v", chat, err)
	}

	comp, err := c.Completions.New(ctx, openai.CompletionNewParams{
		Model:     openai.CompletionNewParamsModel("kvmock"),
		Prompt:    openai.CompletionNewParamsPromptUnion{OfString: openai.String("Once upon a time")},
		MaxTokens: openai.Int(8),
	})
	if err != nil || len(comp.Choices) == 0 || comp.Choices[0].Text == "" || comp.Usage.CompletionTokens != 8 {
		t.Fatalf("completion: %+v %v", comp, err)
	}

	// The Responses API, embeddings (the client's default base64), a batch
	// of prompts and n > 1: what the router forwards (issue 15).
	resp, err := c.Responses.New(ctx, responses.ResponseNewParams{Model: "kvmock",
		Input: responses.ResponseNewParamsInputUnion{OfString: openai.String("Name a colour.")}, MaxOutputTokens: openai.Int(5)})
	if err != nil || resp.OutputText() == "" || resp.Usage.OutputTokens != 5 {
		t.Fatalf("responses: %+v %v", resp, err)
	}
	emb, err := c.Embeddings.New(ctx, openai.EmbeddingNewParams{Model: "kvmock",
		Input: openai.EmbeddingNewParamsInputUnion{OfArrayOfTokenArrays: [][]int64{{1, 2, 3}, {4, 5}}}})
	if err != nil || len(emb.Data) != 2 || len(emb.Data[1].Embedding) != embeddingDims || emb.Usage.PromptTokens != 5 {
		t.Fatalf("embeddings: %+v %v", emb, err)
	}
	batch, err := c.Completions.New(ctx, openai.CompletionNewParams{Model: openai.CompletionNewParamsModel("kvmock"),
		Prompt: openai.CompletionNewParamsPromptUnion{OfArrayOfStrings: []string{"one", "two"}}, MaxTokens: openai.Int(3), N: openai.Int(2)})
	if err != nil || len(batch.Choices) != 4 || batch.Choices[3].Index != 3 || batch.Usage.CompletionTokens != 12 {
		t.Fatalf("batch of 2, n=2: %+v %v", batch, err)
	}

	// Errors come back as API errors with the status.
	_, err = c.Completions.New(ctx, openai.CompletionNewParams{
		Model:     openai.CompletionNewParamsModel("kvmock"),
		Prompt:    openai.CompletionNewParamsPromptUnion{OfString: openai.String("x")},
		MaxTokens: openai.Int(0),
	})
	var apiErr *openai.Error
	if err == nil || !errors.As(err, &apiErr) || apiErr.StatusCode != 400 {
		t.Fatalf("max_tokens 0: %v", err)
	}
}
